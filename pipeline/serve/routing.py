"""Where an agent turn goes: the pool's live workers and desired version (cached per server), each
worker's load in active sessions, and the bounded-load choice (`pipeline.core.affinity.choose`).

A worker's load is the number of active sessions homed there (`keys.PoolKeys.homed_sessions`: a
session counts while it had a turn in the last `ACTIVE_S`, and leaves its old home's count when it
moves), read at most every `LOADS_TTL_S` and counted locally in between. A server's turn reads them
through `fresh`: on the event loop when they are fresh enough, in a thread when some must be read
again. Sessions, not turns in flight, because a session keeps coming back: counting turns in
flight, which come and go with each answer, moved sessions for nothing whenever one worker's
answers happened to lag (measured: 18 % of turns moved).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Hashable
from functools import partial

import anyio
import redis

from pipeline.core import adapters
from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, Route, choose
from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.errors import PipelineError
from pipeline.submit.placement import Placement
from schemas.adapters import pinned
from schemas.worker_info import WorkerInfo

log = logging.getLogger(__name__)

WORKERS_TTL_S = 1.0  # live workers are read at most this often per server
REREAD_S = 0.25  # the pool's adapters are read again at most this often for a name not among them
LOADS_TTL_S = 0.05  # workers' loads are read at most this often per server (counted locally between)
ACTIVE_S = 120.0  # a session without a turn for this long no longer counts in its home's load
# While a refresh runs in the background, reads this young still serve: a turn never waits for one.
STALE_SERVES_S = 10.0


def _log_failure(task: asyncio.Task[None]) -> None:
    """A refresh that failed: said in the log (a turn that awaited it got the error too)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("reading the pool's workers, weights and loads failed: %s", task.exception())


class Router:
    """One pool's routing state, as one server sees it."""

    def __init__(self, conn: redis.Redis, pool_keys: keys.PoolKeys, *, affinity: bool = True,
                 load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        self.conn = conn
        self.keys = pool_keys
        self.affinity = affinity  # False: every turn to the shared lane, whichever worker is free (the baseline)
        self.load_factor = load_factor
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._desired: tuple[float, int | None] = (0.0, None)
        self._adapters: tuple[float, dict[str, int]] = (0.0, {})
        self._loads: tuple[float, dict[str, int]] = (0.0, {})
        # Sessions this server placed (+1) or moved away (-1) whose load entries are not yet written.
        self._unwritten: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._refreshing: asyncio.Task[None] | None = None  # a refresh under way in a thread (`fresh`)

    def _serves(self, read_at: float, ttl_s: float) -> bool:
        """Whether a read made at `read_at` still serves: within its `ttl_s`, or within `STALE_SERVES_S`
        while a refresh is under way."""
        age = time.monotonic() - read_at
        return age <= ttl_s or (self._refreshing is not None and read_at > 0 and age <= STALE_SERVES_S)

    async def fresh(self, *, adapters_within_s: float = WORKERS_TTL_S) -> None:
        """Make the cached reads serve a turn on the server's loop, which never waits on Redis for them:
        the stale ones are read again in a thread, awaited only when some are older than
        `STALE_SERVES_S` (a server's first turn, or its first after a quiet spell) or the adapters older
        than `adapters_within_s` (a name no adapter had: looked up again); else the turn goes on with
        them while they are read."""
        with self._lock:
            read_ats = [self._workers[0], self._desired[0], self._adapters[0], self._loads[0]]
        ttls = [WORKERS_TTL_S, WORKERS_TTL_S, WORKERS_TTL_S, LOADS_TTL_S]
        now = time.monotonic()
        if all(now - read_at <= ttl for read_at, ttl in zip(read_ats, ttls, strict=True)) \
                and now - read_ats[2] <= adapters_within_s:
            return
        if self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh(adapters_within_s))
            self._refreshing.add_done_callback(_log_failure)
        looked_up = adapters_within_s < WORKERS_TTL_S and now - read_ats[2] > adapters_within_s
        if looked_up or any(read_at == 0 or now - read_at > STALE_SERVES_S for read_at in read_ats):
            await asyncio.shield(self._refreshing)

    async def _refresh(self, adapters_within_s: float) -> None:
        try:
            await anyio.to_thread.run_sync(partial(self._read_all, adapters_within_s))
        finally:
            self._refreshing = None

    def _read_all(self, adapters_within_s: float) -> None:
        """Read again what is stale (in a thread)."""
        now = time.monotonic()
        self.desired_version(force=now - self._desired[0] > WORKERS_TTL_S)
        self.adapter_versions(force=now - self._adapters[0] > min(adapters_within_s, WORKERS_TTL_S))
        workers = self.live_workers(force=now - self._workers[0] > WORKERS_TTL_S)
        self.loads(workers, force=now - self._loads[0] > LOADS_TTL_S)

    def known_workers(self) -> list[WorkerInfo]:
        """The live workers as last read, without reading (for the server's loop)."""
        return self._workers[1]

    def live_workers(self, *, force: bool = False) -> list[WorkerInfo]:
        with self._lock:
            read_at, workers = self._workers
            if force or not self._serves(read_at, WORKERS_TTL_S):
                workers = registry.live_workers(self.conn, self.keys.name)
                self._workers = (time.monotonic(), workers)
            return workers

    def desired_version(self, *, force: bool = False) -> int | None:
        with self._lock:
            read_at, version = self._desired
            if force or not self._serves(read_at, WORKERS_TTL_S):
                try:
                    version = control_channel.read_state(self.conn, self.keys.name).weight_version
                except PipelineError:
                    version = None
                self._desired = (time.monotonic(), version)
            return version

    def adapter_versions(self, *, fresh: bool = False, force: bool = False) -> dict[str, int]:
        """The pool's adapters' current versions (read at most every `WORKERS_TTL_S` per server; with
        `fresh`, every `REREAD_S`: a name no adapter had a moment ago is looked up again, but a client
        naming no adapter on every call costs at most a read each `REREAD_S`)."""
        with self._lock:
            read_at, versions = self._adapters
            if force or not self._serves(read_at, REREAD_S if fresh else WORKERS_TTL_S):
                records = adapters.records(self.conn, self.keys.name)
                versions = {name: record.version for name, record in records.items()}
                self._adapters = (time.monotonic(), versions)
            return versions

    def loads(self, workers: list[WorkerInfo], *, force: bool = False) -> dict[str, int]:
        """Active sessions homed at each live worker (read at most every `LOADS_TTL_S`; the sessions
        this server places or moves in between are counted as it does)."""
        with self._lock:
            read_at, loads = self._loads
            if not force and self._serves(read_at, LOADS_TTL_S) and set(loads) == {w.worker_id for w in workers}:
                return loads
        now = time.time()
        with self.conn.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.zcount(self.keys.homed_sessions(worker.worker_id), now, "+inf")
            counts = pipe.execute()
        with self._lock:
            loads = {w.worker_id: int(c) + self._unwritten[w.worker_id] for w, c in zip(workers, counts, strict=True)}
            self._loads = (time.monotonic(), loads)
        return loads

    def route(self, session_id: str, home: str | None, workers: list[WorkerInfo], placement: Placement,
              group: Hashable, adapter: str | None = None) -> Route:
        """The worker for a session's turn (`affinity.choose`; on `adapter`, preferring a worker with
        its current version resident), counted in its load at once."""
        if not self.affinity:
            return Route(None)

        def can_serve(worker: WorkerInfo) -> bool:
            if not placement.classes:
                return True
            index = placement.classes.index(worker.capabilities)
            return not isinstance(group, tuple) or index in group

        prefers = None
        version = self.adapter_versions().get(adapter) if adapter is not None else None
        if adapter is not None and version is not None:
            key = pinned(adapter, version)

            def prefers(worker: WorkerInfo) -> bool:
                return key in worker.adapters

        loads = self.loads(workers)
        route = choose(session_id, home, workers, loads, can_serve=can_serve, desired_version=self.desired_version(),
                       load_factor=self.load_factor, prefers=prefers)
        if route.worker is not None and route.worker != home:
            with self._lock:
                loads[route.worker] = loads.get(route.worker, 0) + 1
                self._unwritten[route.worker] += 1
                if home is not None:
                    loads[home] = max(0, loads.get(home, 0) - 1)
                    self._unwritten[home] -= 1
        return route

    def written(self, worker: str | None, home: str | None) -> None:
        """A moved session's load entries are written (or never will be): no longer counted apart."""
        if worker is not None and home != worker:
            with self._lock:
                self._unwritten[worker] -= 1
                if home is not None:
                    self._unwritten[home] += 1
