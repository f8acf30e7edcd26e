"""A worker's load of a version from a weight store (`pipeline.weights.store`), as its ack reports it.

An engine with `apply_store_version(store, have, version)` (hf in its own process; vllm-http
through the worker extension the project ships) applies the deltas in place from the version
it serves, or rebuilds from the full version, and checks every tensor's checksum
(`workers.engines.inplace`). An engine without it cannot take a store push: the load fails
with what to do instead (push a checkpoint directory).
"""

from __future__ import annotations

from typing import Any

from pipeline.weights.store import WeightStore
from workers.engines.base import Engine
from workers.errors import EngineUnavailableError


def load_from_store(engine: Engine, url: str, version: int, have: int | None) -> dict[str, Any]:
    """Bring `engine` to `version` of the store at `url`; the ack's `applied`, `bytes_read`, `detail`."""
    apply = getattr(engine, "apply_store_version", None)
    if apply is None:
        raise EngineUnavailableError(
            f"the {engine.description.name} engine cannot load weights from a weight store; push a checkpoint "
            "directory instead (`pipeline weights push PATH` without --delta/--store)")
    applied = apply(WeightStore(url), have, version)
    return {"applied": applied.how, "bytes_read": applied.bytes_read, "detail": applied.detail}
