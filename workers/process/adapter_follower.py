"""Adapter pushes, worker side: each adapter version the pool's control state names is read from
its store, checked, staged on the engine and acknowledged.

An adapter push (`pipeline.weights.adapter_push`) publishes the version in the pool's adapter
registry, then names it in the control state (`pipeline.core.broker.control_channel.announce_adapter`).
On the first read of a state naming a version newer than the one it answered, a worker whose engine
serves adapters reads the registry's record (the pushed version, or a newer one a racing push
published), reads that version from the store and checks every tensor's checksum
(`AdapterCache.stage`), and acknowledges it: from then on every job it admits pins that version or a
newer one (`workers.jobs.adapters`), and the first batch naming it loads it without reading the
store. Nothing pauses: jobs already admitted finish on the version they pinned, unless the push is
partial (`DesiredState.adapter_swap_modes`): then, before it answers, the worker stops the samples in
flight (`Feeder.partial_swap`, on an engine that can interrupt) if any job runs an older version of
the adapter, pins those jobs to the new version (`Feeder.repin_adapter`) and continues every stopped
sample; the rows keep each token's adapter version (`adapter_version_segments`). An engine that
cannot stop samples lets them finish on their version and says so in its answer. A version that
cannot be read or checked is acknowledged `ok: false` with the reason; jobs naming it are then
handed back by this worker, never run on the base weights. A worker that joins later answers the
versions the state names when it first reads it.
"""

from __future__ import annotations

import logging
import time

import redis

from pipeline.core import adapters
from pipeline.core.broker import keys
from schemas.control import DesiredState, WeightAck
from workers.engines.adapters.cache import serves_adapters
from workers.engines.base import Engine
from workers.errors import UnsupportedRequestError
from workers.jobs.feeder import Feeder
from workers.process.acks import write_ack

log = logging.getLogger(__name__)


class AdapterFollower:
    """One worker's answers to its pool's adapter pushes (see the module docstring)."""

    def __init__(self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, engine: Engine,
                 feeder: Feeder) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.engine = engine
        self.feeder = feeder
        self.answered: dict[str, WeightAck] = {}  # adapter name -> this worker's newest answer
        self._generation = -1  # the last control generation whose adapters were followed

    def follow(self, state: DesiredState) -> None:
        """Answer each adapter version `state` names that this worker has not answered yet (once per
        generation of the state; a lost answer is written again at the next generation)."""
        if state.generation == self._generation or not serves_adapters(self.engine):
            return
        for name, version in sorted(state.adapters.items()):
            answered = self.answered.get(name)
            if answered is not None and answered.version >= version:
                write_ack(self.conn, answered, self.pool.name, only_if_missing=True)
                continue
            ack = self._stage(name, version)
            if ack.ok and state.adapter_swap_modes.get(name) == "partial":
                ack = self._continue_on(ack)
            self.answered[name] = ack
            write_ack(self.conn, ack, self.pool.name)
        self._generation = state.generation

    def _stage(self, name: str, version: int) -> WeightAck:
        """Read and check the registry's version of `name` (at least `version`): this worker's answer."""
        started = time.monotonic()
        record = adapters.records(self.conn, self.pool.name).get(name)
        try:
            if record is None or record.version < version:
                held = "no version" if record is None else f"v{record.version}"
                raise UnsupportedRequestError(f"the pool's adapter registry holds {held} of {name!r}, not v{version} "
                                              "(removed, or its push undone)")
            read = self.engine.adapters.stage(record)  # type: ignore[attr-defined]
        except UnsupportedRequestError as exc:
            log.error("worker %s: adapter %s v%d not staged: %s", self.worker_id, name, version, exc)
            return WeightAck(worker=self.worker_id, version=version, ok=False, seconds=0.0, error=str(exc),
                             adapter=name)
        seconds = time.monotonic() - started
        log.info("worker %s: adapter %s v%d read and checked (%.2f MB in %.2f s)", self.worker_id, name,
                 record.version, read / 1e6, seconds)
        return WeightAck(worker=self.worker_id, version=record.version, ok=True, seconds=0.0,
                         prepare_seconds=float(seconds), applied="full", bytes_read=read, adapter=name)

    def _continue_on(self, ack: WeightAck) -> WeightAck:
        """A partial push's staged version `ack`: the samples in flight on an older version of its
        adapter stopped and continued on it (every sample the engine runs is stopped and continued,
        those of other policies on their own). The answer says how many were stopped, or why none."""
        name, version = ack.adapter, ack.version
        assert name is not None
        feeder = self.feeder
        jobs = feeder.adapter_jobs(name, version)
        if not jobs:
            return ack.model_copy(update={"mode": "partial", "detail": "no sample in flight on an older version"})
        if not feeder.can_interrupt:
            log.warning("worker %s: partial push of adapter %s v%d, but the %s engine cannot stop samples in flight; "
                        "%d job(s) finish on the version they pinned", self.worker_id, name, version,
                        self.engine.description.name, jobs)
            return ack.model_copy(update={"detail": f"the {self.engine.description.name} engine cannot stop samples "
                                                    f"in flight: {jobs} job(s) finish on the version they pinned"})
        started = time.monotonic()
        repinned: list[int] = []
        stopped = feeder.partial_swap(lambda: repinned.append(feeder.repin_adapter(name, version)))
        paused = time.monotonic() - started
        log.info("worker %s: partial push of adapter %s v%d: %d sample(s) stopped, %d job(s) continued on it",
                 self.worker_id, name, version, stopped, sum(repinned))
        return ack.model_copy(update={"mode": "partial", "seconds": paused,
                                      "detail": f"{stopped} sample(s) stopped, {sum(repinned)} job(s) continued on "
                                                f"v{version}"})
