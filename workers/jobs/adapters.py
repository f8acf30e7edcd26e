"""A job's adapters: each request naming one gets the pool's current version pinned to it.

Before a job runs, every adapter its requests name is looked up in the pool's registry
(`pipeline.core.adapters`) once; the version found is the one every sample of the job runs
under (continued samples after a partial swap included) and the one its rows record. A job
naming an adapter the pool no longer has, or one on a worker whose engine serves no adapters,
is refused (`UnsupportedRequestError`): handed back for another worker, never run on the base.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pipeline.core import adapters
from schemas.adapters import pinned
from schemas.request import RolloutRequest
from workers.engines.adapter_cache import serves_adapters
from workers.engines.base import Engine
from workers.errors import UnsupportedRequestError, WorkerError


def pin_adapters(requests: Sequence[RolloutRequest], engine: Engine, conn: redis.Redis | None,
                 pool: str) -> list[RolloutRequest]:
    """`requests` with each adapter pinned to its current version (told to the engine's cache)."""
    named = [r for r in requests if r.adapter is not None]
    if not named:
        return list(requests)
    if not serves_adapters(engine):
        raise UnsupportedRequestError(
            f"request {named[0].id!r} names adapter {named[0].adapter!r}; the {engine.description.name} engine "
            "serves no LoRA adapters (the hf, sim, sglang-http and vllm-http engines do)")
    if conn is None:
        raise WorkerError("a job naming adapters needs a Redis connection to look them up")
    found = adapters.records(conn, pool)
    versions: dict[str, int] = {}
    for request in named:
        name = request.adapter
        assert name is not None
        if name in versions:
            continue
        record = found.get(name)
        if record is None:
            raise UnsupportedRequestError(f"request {request.id!r}: {adapters.unknown(name, found, pool)}")
        engine.adapters.note(record)  # type: ignore[attr-defined]
        versions[name] = record.version
    return [r.model_copy(update={"adapter": pinned(r.adapter, versions[r.adapter])}) if r.adapter is not None else r
            for r in requests]
