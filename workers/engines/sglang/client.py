"""The sglang-http engine's client: `http_client.GenerateClient` over SGLang's native `/generate`.

SGLang tracks a call under its `rid` (an `n`-call under `{rid}_{i}`, `GenerateCall.sglang_rids`)
and aborts each with `POST /abort_request {"rid"}`; behind a gateway, on every server behind it
(`workers.engines.http.backends`).

A request's `routing_key` goes in the `X-SMG-Routing-Key` header. Between several `--url`s the
client picks the server itself (`http_client.ServerPool`); behind the gateway (`smg` 1.13) the
gateway does. Its `consistent_hashing` policy hashes that header's value onto its ring of healthy
workers (smg-project/smg, model_gateway/src/policies/consistent_hashing.rs: "`X-SMG-Routing-Key`:
Consistent hash routing for session affinity"); `--routing-key-headers` names the headers read,
`x-smg-routing-key` by default (smg-project/smg-docs,
src/lib/content/concepts/routing/sticky-sessions.md). Measured on smg 1.13.0 `/generate` (a key
per session, a unique `rid` per call): the header pins under `--policy consistent_hashing`,
`manual` and `prefix_hash`, and under `--routing-key-override` (`--sticky-sessions`) on
`round_robin` and `cache_aware`. Use `--policy consistent_hashing`: the same docs say that under
the override a body `rid` wins over the header, and each call's `rid` is unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engines.http.backends import Backends
from workers.engines.http.client import Aborts, GenerateClient, RetryPolicy, Wire

ROUTING_HEADER = "X-SMG-Routing-Key"

__all__ = ["ROUTING_HEADER", "RetryPolicy", "SGLangClient", "sglang_wire"]


def sglang_wire(backends: Backends) -> Wire:
    async def abort(url: str, rids: list[str], timeout_s: float) -> Aborts:
        return {rid: await backends.abort(rid, via=url, timeout_s=timeout_s) for rid in rids}

    return Wire(server="SGLang", path="/generate", ids=lambda call: call.sglang_rids, abort=abort,
                routing_header=ROUTING_HEADER)


class SGLangClient(GenerateClient):
    """All HTTP traffic of the sglang-http engine. Use from one event loop."""

    def __init__(self, urls: Sequence[str], **options: Any) -> None:
        super().__init__(urls, sglang_wire, **options)
