"""The sglang-http engine's client: `http_client.GenerateClient` over SGLang's native `/generate`.

SGLang tracks a call under its `rid` (an `n`-call under `{rid}_{i}`, `GenerateCall.sglang_rids`)
and aborts each with `POST /abort_request {"rid"}`; behind a gateway, on every server behind it
(`sglang_backends`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engines.http.client import Aborts, GenerateClient, RetryPolicy, Wire
from workers.engines.sglang.backends import Backends

__all__ = ["RetryPolicy", "SGLangClient", "sglang_wire"]


def sglang_wire(backends: Backends) -> Wire:
    async def abort(url: str, rids: list[str], timeout_s: float) -> Aborts:
        return {rid: await backends.abort(rid, via=url, timeout_s=timeout_s) for rid in rids}

    return Wire(server="SGLang", path="/generate", ids=lambda call: call.sglang_rids, abort=abort)


class SGLangClient(GenerateClient):
    """All HTTP traffic of the sglang-http engine. Use from one event loop."""

    def __init__(self, urls: Sequence[str], **options: Any) -> None:
        super().__init__(urls, sglang_wire, **options)
