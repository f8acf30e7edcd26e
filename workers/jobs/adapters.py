"""A job's adapters: each request naming one gets the pool's current version pinned to it.

Before a job runs, every adapter its requests name is looked up in the pool's registry
(`pipeline.core.adapters`) once; the version found is the one every sample of the job runs
under (continued samples after a partial weight swap included) and the one its rows record. A job
naming an adapter the pool no longer has, or one on a worker whose engine serves no adapters,
is refused (`UnsupportedRequestError`): handed back for another worker, never run on the base.
A job resumed from a checkpoint is pinned again to the versions its saved tokens came from
(`pin_stored`, `repin`), whatever the current one is: a sample continues on the version it ran on.
Only a partial adapter push moves the samples in flight on to a newer version
(`workers.jobs.feeder.Feeder.repin_adapter`); their rows then keep each token's adapter version.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pipeline.core import adapters
from pipeline.core.errors import PipelineError
from schemas.adapters import pinned, split_pinned
from schemas.request import RolloutRequest
from workers.engines.adapters.cache import serves_adapters
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


def job_adapters(requests: Sequence[RolloutRequest]) -> dict[str, int]:
    """The adapter versions pinned `requests` run on (name -> version)."""
    found: dict[str, int] = {}
    for request in requests:
        if request.adapter is not None:
            name, version = split_pinned(request.adapter)
            if version is not None:
                found[name] = version
    return found


def pin_stored(versions: dict[str, int], engine: Engine, conn: redis.Redis, pool: str) -> None:
    """Tell the engine's cache where each adapter version of `versions` (a checkpoint's) is stored.
    `UnsupportedRequestError` when one is no longer stored (pruned) or the adapter is gone: the
    caller then starts the samples over."""
    current = adapters.records(conn, pool)
    for name, version in versions.items():
        record = current.get(name)
        if record is None:
            raise UnsupportedRequestError(adapters.unknown(name, current, pool))
        if record.version != version:
            try:
                record = adapters.stored_record(record.url, name, version)
            except (PipelineError, OSError) as exc:
                raise UnsupportedRequestError(f"adapter {name!r} v{version} is no longer stored: {exc}") from exc
        engine.adapters.note(record)  # type: ignore[attr-defined]


def repin(requests: Sequence[RolloutRequest], versions: dict[str, int]) -> list[RolloutRequest]:
    """Pinned `requests` pinned instead to `versions` (name -> version) for the adapters it names."""
    out = []
    for request in requests:
        name = None if request.adapter is None else split_pinned(request.adapter)[0]
        if name is not None and name in versions:
            request = request.model_copy(update={"adapter": pinned(name, versions[name])})
        out.append(request)
    return out
