"""A push through a weight store: write the version (a delta where it can), point the pool at it, prune.

The control state carries only the store's URL and the version (`weight_source="store"`);
every byte of the weights goes through the store. After every live worker acknowledged, the
versions no live worker needs are deleted: those before the full version from which the oldest
version a live worker serves (or the pushed one) is rebuilt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import redis

from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.broker.security import check_weight_path
from pipeline.core.errors import WeightPushError, WeightVersionError
from pipeline.core.weights.safetensors_io import TensorBits
from pipeline.core.weights.store import StoreError, WeightStore, default_url
from pipeline.weights.writer import DEFAULT_FULL_EVERY, write_version
from schemas.control import SwapMode


@dataclass
class StorePushResult(control_channel.PushResult):
    """A push's acknowledgements, and what it stored: `kind` ("full" or "delta"), the bytes it
    added to the store, the bytes of the model at that version, and the versions pruned."""

    kind: str = "full"
    stored_bytes: int = 0
    model_bytes: int = 0
    pruned: list[int] = field(default_factory=list)


def store_url(store: str | None, pool: str | None) -> str:
    return store or default_url(keys.pool_name(pool))


def push_via_store(
    conn: redis.Redis,
    tensors: Iterable[TensorBits],
    version: int,
    *,
    store: str | None = None,
    delta: bool = True,
    full_every: int = DEFAULT_FULL_EVERY,
    timeout: float | None = control_channel.DEFAULT_PUSH_TIMEOUT_S,
    force: bool = False,
    mode: SwapMode = "drain",
    pool: str | None = None,
) -> StorePushResult:
    """Store `tensors` as `version` at `store` (default: the pool's), then push it to every live worker.

    With `force`, a version already in the store is pushed again as stored (a retry)."""
    url = store_url(store, pool)
    check_weight_path(url)
    current = control_channel.read_state(conn, pool).weight_version
    if version <= current and not force:
        raise WeightVersionError(f"weight version {version} is not newer than the current version {current}; "
                                 "push a higher version or pass force")
    weights = WeightStore(url)
    if force and version in weights.versions():
        manifest = weights.manifest(version)
        kind, stored, model = manifest.kind, manifest.stored_bytes, manifest.model_bytes
    else:
        written = write_version(weights, tensors, version, delta=delta, full_every=full_every)
        kind, stored, model = written.manifest.kind, written.stored_bytes, written.model_bytes
    try:
        result = control_channel.push_weights(conn, url, version, timeout=timeout, force=force, mode=mode,
                                              pool=pool, source="store")
    except WeightPushError as exc:
        if exc.rolled_back is not None and weights.latest() == version:
            weights.remove(version)  # no worker took it: the version can be pushed again, with any weights
        raise
    served = [w.weight_version for w in registry.live_workers(conn, keys.pool_name(pool))]
    stored_versions = set(weights.versions())
    keep_from = min([v for v in served if v in stored_versions and v <= version] + [version])
    try:
        pruned = weights.prune(keep_from)
    except StoreError:
        pruned = []
    return StorePushResult(version=result.version, path=result.path, generation=result.generation,
                           seconds=result.seconds, acks=result.acks, kind=kind, stored_bytes=stored,
                           model_bytes=model, pruned=pruned)
