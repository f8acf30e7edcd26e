"""An adapter push: a checked LoRA adapter into its versioned store, then the pool's registry.

Each adapter has a weight store of its own under the pool's (`<store>/adapters/<name>`), one full
version per push (an adapter is megabytes; no deltas). The version is written completely,
manifest last, before the registry names it (`pipeline.core.adapters.publish`): a push that fails
part-way leaves the previous version current and nothing half-written served. Workers load an
adapter version from the store when a job names the adapter (`workers.jobs.adapters`), so a
worker that joins later, or evicted the adapter, reads the same bits.

The push is acknowledged: it names the version in the pool's control state and waits until every
live worker serving adapters has read and checked it (`workers.process.adapter_follower`), so
that every job any worker admits after the push returns runs it, and a worker that cannot read
the store is named now (`AdapterPushError`), not found out later from handed-back jobs. Jobs
already admitted finish on the version they pinned: nothing pauses. All or nothing: when no
worker took the version (each failed or did not answer), the registry and the state name the
previous version again. With no live worker serving adapters the push is recorded for those that
join (each answers when it first reads the state).

A push that is current prunes the adapter's store down to its last `keep` versions (default
`DEFAULT_KEEP_VERSIONS`; 0 keeps every version), never one a live worker of the pool holds
resident (a job running on it may read it again): a run that pushes each step keeps megabytes,
not gigabytes. `pipeline verify` of a row needs its version, so keep what you will verify.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from pipeline.core import adapters
from pipeline.core.adapters import CONFIG_FILE, DEFAULT_KEEP_VERSIONS, adapter_url
from pipeline.core.broker import keys, registry
from pipeline.core.broker.control_channel import DEFAULT_PUSH_TIMEOUT_S, announce_adapter, withdraw_adapter
from pipeline.core.broker.security import check_weight_path
from pipeline.core.errors import AdapterError, AdapterPushError
from pipeline.core.weights.store import WeightStore, checksum, version_dir
from pipeline.weights.adapter_check import Adapter, base_shapes_of_dir, check_fits
from pipeline.weights.push import store_url
from schemas.adapters import ADAPTER_NAME_PATTERN, AdapterRecord, split_pinned
from schemas.control import SwapMode, WeightAck


@dataclass(frozen=True)
class AdapterPushResult:
    """What a push stored: the adapter's new version, its bytes, the seconds it took, and whether it
    is the current version (False: a racing push of a newer version of the same name finished first),
    the older versions it pruned from the adapter's store, and the workers' acknowledgements."""

    name: str
    version: int
    stored_bytes: int
    seconds: float
    current: bool
    url: str
    pruned: list[int]
    acks: list[WeightAck]  # each live worker serving adapters: read and checked this version (or a newer one)


def base_shapes(conn: redis.Redis, pool: str | None, base: str | None, store: str | None
                ) -> dict[str, tuple[int, ...]]:
    """The base model's tensor shapes an adapter is checked against: `base` (a model directory), else
    the pool's weight store's latest version, else the model directory of a live worker of the pool
    when it is readable here."""
    if base is not None:
        return base_shapes_of_dir(base)
    weights = WeightStore(store_url(store, pool))
    latest = weights.latest()
    if latest is not None:
        return {t.name: tuple(t.shape) for t in weights.manifest(latest).tensors}
    for worker in registry.live_workers(conn, keys.pool_name(pool)):
        if Path(worker.model).is_dir():
            return base_shapes_of_dir(worker.model)
    raise AdapterError(f"pool {keys.pool_name(pool)!r}: no base model to check the adapter against (no weight store "
                       "version, no live worker whose model directory is readable here); name it with --base DIR")


def push_adapter_tensors(
    conn: redis.Redis, name: str, adapter: Adapter, *, base: Mapping[str, tuple[int, ...]],
    pool: str | None = None, store: str | None = None, keep: int = DEFAULT_KEEP_VERSIONS,
    timeout: float | None = DEFAULT_PUSH_TIMEOUT_S, mode: SwapMode = "drain",
) -> AdapterPushResult:
    """Check `adapter` against the `base` shapes, store it as the next version of `name`, publish it,
    wait for the acknowledgements of the pool's workers serving adapters (up to `timeout` seconds;
    None: no limit; `mode="partial"`: each first continues its samples in flight on it), prune the
    store to its last `keep` versions (0: keep all; see the module docstring). `AdapterPushError`
    names the workers that failed or did not answer."""
    if keep < 0:
        raise AdapterError(f"keep must be 0 (every version) or more versions, not {keep}")
    started = time.monotonic()
    check_name(name)
    check_fits(adapter, base, f"adapter {name!r}")
    version = adapters.next_version(conn, pool, name)
    url = adapter_url(store, pool, name)
    check_weight_path(url)
    weights = WeightStore(url)
    out = weights.writer(version, "full", None, version)
    weights.fs.pipe_file(f"{weights.root}/{version_dir(version)}/{CONFIG_FILE}", json.dumps(adapter.config).encode())
    for tensor in adapter.tensors:
        out.add(tensor, "plain", b"", checksum(tensor.words))
    manifest = out.commit()
    record = AdapterRecord(name=name, version=version, url=url, rank=adapter.rank,
                           target_modules=adapter.target_modules, config=adapter.config,
                           stored_bytes=manifest.stored_bytes)
    previous = adapters.records(conn, pool).get(name)
    current = adapters.publish(conn, pool, record)
    answers = announce_adapter(conn, name, version, timeout=timeout, pool=pool, mode=mode)
    if answers.failed or answers.missing:
        undone = not any(ack.ok for ack in answers.acks)
        if undone:
            adapters.restore(conn, pool, name, version, previous)
            withdraw_adapter(conn, name, version, None if previous is None else previous.version, pool)
        raise AdapterPushError(name, version, answers.failed, answers.missing, answers.acks,
                               rolled_back_to=None if previous is None else previous.version, undone=undone)
    pruned = _prune(conn, pool, name, weights, version, keep) if current and keep else []
    return AdapterPushResult(name, version, manifest.stored_bytes, time.monotonic() - started, current, url, pruned,
                             answers.acks)


def _prune(conn: redis.Redis, pool: str | None, name: str, weights: WeightStore, current: int, keep: int) -> list[int]:
    """Delete the versions of adapter `name` older than its last `keep` (up to `current`) that no live
    worker of the pool holds resident; the versions deleted."""
    resident = {version for worker in registry.live_workers(conn, keys.pool_name(pool))
                for held, version in map(split_pinned, worker.adapters) if held == name}
    kept = sorted(v for v in weights.versions() if v <= current)[-keep:]
    gone = [v for v in weights.versions() if v < kept[0] and v not in resident]
    for version in gone:
        weights.remove(version)
    return gone


def check_name(name: str) -> None:
    """`AdapterError` for a name the request schema would refuse."""
    if not re.match(ADAPTER_NAME_PATTERN, name):
        raise AdapterError(f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                           "letter or digit")
