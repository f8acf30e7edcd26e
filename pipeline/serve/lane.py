"""The interactive lane: agent turns as jobs in their pool's lane queue, and their answers.

Workers take the lane queue (`keys.PoolKeys.lane_queue_name`) before their pool's batch queue,
so a turn waits for a free slot in the engine, not behind a 10 000-request run. A lane job is
the project's job function like any batch (same allow-list, admission, retries, hand-backs,
engine road); its payload carries one `TurnTag` per request, so the worker logs each turn's
rows and answers its server (`workers.jobs.turn_log`) instead of writing a shard of one row.

Each turn goes to a worker chosen by `pipeline.core.affinity` (its session's home while that
is alive, able and not overloaded) through that worker's own lane (`pipeline.core.jobs.lanes`); with
no such worker it waits in the pool's shared lane for any. A worker's load is the number of
active sessions homed there (`keys.PoolKeys.lane_load`: a session counts while it had a turn in
the last `ACTIVE_S`, and leaves its old home's count when it moves), read at most every
`LOADS_TTL_S` and counted locally in between. Sessions, not turns in flight, because a session
keeps coming back: counting turns in flight, which come and go with each answer, moved sessions
for nothing whenever one worker's answers happened to lag (measured: 18 % of turns moved).
While waiting, a server moves the turns of workers that died to the shared lane
(`lanes.rehome_orphans`), so a turn whose worker was killed runs again elsewhere within the
registry's expiry (three heartbeats) and a second.

Turns that reach a server together travel together: a flusher thread enqueues the turns
waiting when it comes round as one job (per run, output, worker class and target worker). While the server's
lane jobs in flight already keep the pool's live workers busy (two jobs each), new turns wait
for one of those to be answered (at most `HOLD_S`), so under load RQ's per-job cost is paid
once for many turns; a turn reaching an idle pool is enqueued at once. A failed job fails each
of its turns (RQ retries it once first).

`wait` blocks on the turn's reply list, checking between blocks whether its job failed; past
the turn timeout it says 503 (`Retry-After`) when no live worker of the pool could take the
turn or the pool is paused, else 504. The job stays queued: the agent's retry of the same
call waits for it again instead of generating it twice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc
import redis
import redis.asyncio
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, Route, choose
from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.broker.connection import asyncio_twin
from pipeline.core.errors import APIError, CapabilityError, PipelineError
from pipeline.core.jobs import lanes, turn_log
from pipeline.core.jobs.queue import job_data
from pipeline.core.jobs.status import failure_reason, read_status
from pipeline.submit.placement import Placement
from schemas.capabilities import Needs
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.shard import rows_from_ipc
from schemas.worker_info import WorkerInfo

log = logging.getLogger(__name__)

DEFAULT_TURN_TIMEOUT_S = 600.0
TURN_JOB_TIMEOUT_S = 3600
TURN_RETRIES = 1
MAX_TURNS_PER_JOB = 64
ASYNC_CONNECTIONS = 4096  # calls waiting on the event loop at once, a socket each
HOLD_S = 0.05  # the longest a turn waits for others to share its job while the workers are busy
OUTSTANDING_S = 2.0  # a lane job this server enqueued counts as in flight for at most this long
WORKERS_TTL_S = 1.0  # live workers are read at most this often per server
BLOCK_S = 1.0  # how long one wait blocks before checking the job's state
LOADS_TTL_S = 0.05  # workers' loads are read at most this often per server (counted locally between)
REHOME_S = 1.0  # dead workers' lanes are looked for at most this often per server
ACTIVE_S = 120.0  # a session without a turn for this long no longer counts in its home's load


@dataclass
class _Waiting:
    """A turn handed to the flusher, and what became of it."""

    request: RolloutRequest
    turn: TurnTag
    run: str
    output: str
    needs: Needs
    group: Hashable
    worker: str | None
    home: str | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Lane:
    """One pool's interactive lane, as a server uses it."""

    def __init__(self, conn: redis.Redis, pool: str, *, turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S,
                 max_turns_per_job: int = MAX_TURNS_PER_JOB, affinity: bool = True,
                 load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        self.conn = conn
        self.keys = keys.pool(pool)
        self.turn_timeout_s = turn_timeout_s
        self.max_turns_per_job = max_turns_per_job
        self.affinity = affinity  # False: every turn to the shared lane, whichever worker is free (the baseline)
        self.load_factor = load_factor
        self.queue = Queue(self.keys.lane_queue_name, connection=conn, serializer=JSONSerializer)
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._desired: tuple[float, int | None] = (0.0, None)
        self._loads: tuple[float, dict[str, int]] = (0.0, {})
        # Sessions this server placed (+1) or moved away (-1) whose load entries are not yet written.
        self._unwritten: Counter[str] = Counter()
        self._rehomed_at = 0.0
        self._lock = threading.Lock()
        self._waiting: list[_Waiting] = []
        self._ready = threading.Condition()
        self._flusher: threading.Thread | None = None
        self._aconn: redis.asyncio.Redis | bool | None = False  # made on first use, in the server's loop
        self._wait_threads: anyio.CapacityLimiter | None = None
        self._jobs: dict[str, tuple[int, float]] = {}  # this server's lane jobs: turns unanswered, enqueued at
        self._job_of_turn: dict[str, str] = {}

    def live_workers(self) -> list[WorkerInfo]:
        with self._lock:
            read_at, workers = self._workers
            if time.monotonic() - read_at > WORKERS_TTL_S:
                workers = registry.live_workers(self.conn, self.keys.name)
                self._workers = (time.monotonic(), workers)
            return workers

    def desired_version(self) -> int | None:
        with self._lock:
            read_at, version = self._desired
            if time.monotonic() - read_at > WORKERS_TTL_S:
                try:
                    version = control_channel.read_state(self.conn, self.keys.name).weight_version
                except PipelineError:
                    version = None
                self._desired = (time.monotonic(), version)
            return version

    def loads(self, workers: list[WorkerInfo]) -> dict[str, int]:
        """Active sessions homed at each live worker (read at most every `LOADS_TTL_S`; the sessions
        this server places or moves in between are counted as it does)."""
        with self._lock:
            read_at, loads = self._loads
            if time.monotonic() - read_at <= LOADS_TTL_S and set(loads) == {w.worker_id for w in workers}:
                return loads
        now = time.time()
        with self.conn.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.zcount(self.keys.lane_load(worker.worker_id), now, "+inf")
            counts = pipe.execute()
        with self._lock:
            loads = {w.worker_id: int(c) + self._unwritten[w.worker_id] for w, c in zip(workers, counts, strict=True)}
            self._loads = (time.monotonic(), loads)
        return loads

    def route(self, session_id: str, home: str | None, workers: list[WorkerInfo], placement: Placement,
              group: Hashable) -> Route:
        """The worker for a session's turn (`affinity.choose`), counted in its load at once."""
        if not self.affinity:
            return Route(None)

        def can_serve(worker: WorkerInfo) -> bool:
            if not placement.classes:
                return True
            index = placement.classes.index(worker.capabilities)
            return not isinstance(group, tuple) or index in group

        loads = self.loads(workers)
        route = choose(session_id, home, workers, loads, can_serve=can_serve, desired_version=self.desired_version(),
                       load_factor=self.load_factor)
        if route.worker is not None and route.worker != home:
            with self._lock:
                loads[route.worker] = loads.get(route.worker, 0) + 1
                self._unwritten[route.worker] += 1
                if home is not None:
                    loads[home] = max(0, loads.get(home, 0) - 1)
                    self._unwritten[home] -= 1
        return route

    def enqueue(self, request: RolloutRequest, *, run: str, output: str, turn: TurnTag,
                home: str | None = None) -> Route:
        """Enqueue the turn (with whatever other turns wait with it) on the worker `route` chooses;
        400 when no live worker of the pool could serve what it asks."""
        workers = self.live_workers()
        placement = Placement(workers, self.keys.name)
        needs, group = placement.place(request, request.id)
        try:
            placement.check()
        except CapabilityError as exc:
            raise APIError(400, str(exc).replace("nothing was enqueued:\n  ", ""), code="unservable") from None
        route = self.route(turn.session_id, home, workers, placement, group)
        waiting = _Waiting(request, turn, run, output, needs, (run, output, group, route.worker), route.worker, home)
        with self._ready:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="lane-flusher", daemon=True)
                self._flusher.start()
            self._waiting.append(waiting)
            self._ready.notify()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return route

    def _flush_loop(self) -> None:
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                # Flow control: while this server's earlier lane jobs keep the pool's workers busy, turns
                # wait here (at most HOLD_S) and go on together; an idle pool gets each turn at once.
                held_until = time.monotonic() + HOLD_S
                while (len(self._waiting) < self.max_turns_per_job and self._busy()
                       and (left := held_until - time.monotonic()) > 0):
                    self._ready.wait(left)
                batch, self._waiting = self._waiting, []
            groups: dict[Hashable, list[_Waiting]] = {}
            for waiting in batch:
                groups.setdefault(waiting.group, []).append(waiting)
            for group in groups.values():
                for start in range(0, len(group), self.max_turns_per_job):
                    self._enqueue_job(group[start:start + self.max_turns_per_job])

    def _busy(self) -> bool:
        """Whether this server's lane jobs in flight are enough to keep the pool's live workers busy
        (two per worker: one running, one taken next); jobs older than `OUTSTANDING_S` no longer count."""
        now = time.monotonic()
        recent = sum(1 for _, enqueued in self._jobs.values() if now - enqueued < OUTSTANDING_S)
        return recent >= 2 * max(1, len(self.live_workers()))

    def _answered(self, turn_id: str) -> None:
        """A turn this server enqueued is answered (or given up): its job counts down."""
        with self._ready:
            job_id = self._job_of_turn.pop(turn_id, None)
            if job_id is None or job_id not in self._jobs:
                return
            left, enqueued = self._jobs[job_id]
            if left <= 1:
                del self._jobs[job_id]
                self._ready.notify()
            else:
                self._jobs[job_id] = (left - 1, enqueued)

    def _enqueue_job(self, turns: list[_Waiting]) -> None:
        try:
            first = turns[0]
            job_id = f"lane-{uuid.uuid4().hex[:16]}"
            payload = JobPayload.pack([t.request for t in turns], run=first.run, job_id=job_id, batch_id=job_id,
                                      output=first.output, submitted_at_ms=int(time.time() * 1000),
                                      turns=[t.turn for t in turns])
            needs = first.needs
            for other in turns[1:]:
                needs |= other.needs
            data = job_data(payload, timeout_s=TURN_JOB_TIMEOUT_S, retries=TURN_RETRIES, needs=needs,
                            description=f"{len(turns)} agent turn(s) of run {first.run}")
            worker = first.worker
            queue = self.queue if worker is None else lanes.worker_queue(self.conn, self.keys, worker)
            with self.conn.pipeline(transaction=True) as pipe:
                for waiting in turns:
                    pipe.set(keys.turn_job(waiting.turn.turn_id), job_id, ex=TURN_JOB_TIMEOUT_S * 2)
                if worker is not None:
                    # Its lane is known from now on, even if it died since it was chosen and its last
                    # lane was already moved: the next `rehome_orphans` moves this job too.
                    pipe.sadd(self.keys.lane_workers, worker)
                    active_until = time.time() + ACTIVE_S
                    pipe.zadd(self.keys.lane_load(worker), {t.turn.session_id: active_until for t in turns})
                    for waiting in turns:
                        if waiting.home is not None and waiting.home != worker:
                            pipe.zrem(self.keys.lane_load(waiting.home), waiting.turn.session_id)
                queue.enqueue_many([data], pipeline=pipe)
                pipe.execute()
            with self._ready:
                self._jobs[job_id] = (len(turns), time.monotonic())
                for waiting in turns:
                    self._job_of_turn[waiting.turn.turn_id] = job_id
        except BaseException as exc:
            for waiting in turns:
                waiting.error = exc
        finally:
            with self._lock:  # written now (or never, if the enqueue failed): no longer counted apart
                for waiting in turns:
                    if waiting.worker is not None and waiting.home != waiting.worker:
                        self._unwritten[waiting.worker] -= 1
                        if waiting.home is not None:
                            self._unwritten[waiting.home] += 1
            for waiting in turns:
                waiting.done.set()

    def job_of(self, turn_id: str) -> str | None:
        job_id = self.conn.get(keys.turn_job(turn_id))
        return None if job_id is None else job_id.decode()

    def wait(self, turn_id: str, run: str, started: float,
             settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        """The turn's rows, once its worker answers; or the answer `settled()` finds recorded (another
        server's waiter took the rows and recorded the turn); `APIError` for a failed or late turn."""
        try:
            return self._wait(turn_id, run, started, settled)
        finally:
            self._answered(turn_id)

    async def wait_async(self, turn_id: str, run: str, started: float,
                         settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        """`wait` on the event loop: the reply's BLPOP on an asyncio Redis client (one socket per call
        waiting, no thread); the checks between blocks in a thread. Where this Redis has no asyncio
        twin (Sentinel, TLS), `wait` in a thread."""
        aconn = self._async_conn()
        if aconn is None:
            if self._wait_threads is None:
                self._wait_threads = anyio.CapacityLimiter(ASYNC_CONNECTIONS)
            return await anyio.to_thread.run_sync(self.wait, turn_id, run, started, settled,
                                                  limiter=self._wait_threads)
        try:
            reply = keys.turn_reply(turn_id)
            while True:
                left = self.turn_timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise await anyio.to_thread.run_sync(self._late, turn_id)
                popped = await aconn.blpop([reply], timeout=max(0.01, min(BLOCK_S, left)))
                if popped is not None:
                    return rows_from_ipc(popped[1])
                found = await anyio.to_thread.run_sync(self._between_blocks, turn_id, run, settled)
                if found is not None:
                    return found
        finally:
            self._answered(turn_id)

    def _wait(self, turn_id: str, run: str, started: float,
              settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        reply = keys.turn_reply(turn_id)
        while True:
            left = self.turn_timeout_s - (time.monotonic() - started)
            if left <= 0:
                raise self._late(turn_id)
            popped = self.conn.blpop([reply], timeout=max(0.01, min(BLOCK_S, left)))
            if popped is not None:
                return rows_from_ipc(popped[1])
            found = self._between_blocks(turn_id, run, settled)
            if found is not None:
                return found

    def _between_blocks(self, turn_id: str, run: str,
                        settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any] | None:
        """After a block without a reply: the answer recorded by another waiter, the rows from the
        turn log (the reply went to a waiter that is gone), None to wait on, or `APIError`."""
        answered = settled()
        if answered is not None:
            return answered
        self._rehome()
        job_id = self.job_of(turn_id)
        status = None if job_id is None else read_status(self.conn, job_id)
        if status == b"finished":  # answered, but the reply went to a waiter that is gone
            logged = self._logged(run, turn_id)
            if logged is not None:
                return logged
            raise APIError(500, "the turn finished but its rows were taken by a server that is gone and are "
                                "in neither the turn log nor a shard it remembers; call again to generate it "
                                "again", code="turn_failed")
        if status == b"queued" and job_id is not None:
            self._rescue(job_id)
        if status in (b"failed", b"stopped", b"canceled") or status is None:
            reason = failure_reason(self.conn, job_id) if status is not None and job_id else \
                "its job is gone from Redis"
            status_code = 400 if "cannot serve" in reason or "Unsupported" in reason else 500
            raise APIError(status_code, f"the turn failed on the worker: {reason}", code="turn_failed")
        return None

    def _rehome(self) -> None:
        """Move dead workers' turns to the shared lane (at most every `REHOME_S` per server)."""
        now = time.monotonic()
        with self._lock:
            if now - self._rehomed_at < REHOME_S:
                return
            self._rehomed_at = now
        with self._lock:
            self._workers = (0.0, self._workers[1])  # read the registry afresh
        live = {w.worker_id for w in self.live_workers()}
        moved = lanes.rehome_orphans(self.conn, self.keys, live)
        if moved:
            log.warning("moved %d lane job(s) of dead worker(s) of pool %r to the shared lane", moved, self.keys.name)

    def _rescue(self, job_id: str) -> None:
        """Requeue a job that a dead worker popped and never started (`lanes.rescue_popped`)."""
        live = {w.worker_id for w in self.live_workers()}
        if lanes.rescue_popped(self.conn, self.keys, job_id, live):
            log.warning("lane job %s was popped by a worker that died before starting it: requeued", job_id)

    def _async_conn(self) -> redis.asyncio.Redis | None:
        if self._aconn is False:
            self._aconn = asyncio_twin(self.conn, max_connections=ASYNC_CONNECTIONS)
        return self._aconn or None

    def _logged(self, run: str, turn_id: str) -> pa.Table | None:
        """A turn's rows from the run's turn log, or from the shard it was flushed to (the reply was
        lost: a waiter gone, or a read that timed out as the reply came)."""
        logged = turn_log.logged_turn(self.conn, run, turn_id)
        if logged is not None:
            return logged
        url = self.conn.get(keys.turn_shard(turn_id))
        if url is None:
            return None
        from pipeline.core.shards import read_rollouts

        session_id, turn, _ = turn_id.rsplit("-", 2)  # `pipeline.serve.turns`: session-turn-nonce
        rows = read_rollouts(url.decode(), filter=(pc.field("session_id") == session_id)
                             & (pc.field("turn") == int(turn)))
        return rows if rows.num_rows else None

    def _late(self, turn_id: str) -> APIError:
        job_id = self.job_of(turn_id)
        status = "" if job_id is None else (read_status(self.conn, job_id) or b"").decode()
        try:
            paused = control_channel.read_state(self.conn, self.keys.name).paused
        except PipelineError:
            paused = False
        if status in ("queued", "scheduled", "deferred", "") and (paused or not self.live_workers()):
            why = f"pool {self.keys.name!r} is paused" if paused else f"no live worker serves pool {self.keys.name!r}"
            retry_after = max(1, int(self.turn_timeout_s // 4))
            return APIError(503, f"{why}; the turn is queued and runs once a worker takes it: call again to get its "
                                 "answer", code="no_worker", headers={"Retry-After": str(retry_after)})
        return APIError(504, f"the turn did not finish within {self.turn_timeout_s:g} s (its job is "
                             f"{status or 'gone'}); call again to wait for it", code="turn_timeout")
