"""The worker's own lane (`pipeline.core.jobs.lanes`): the turns routed to it, taken by a thread of
their own straight into the feeder, and ended on the lane's lists instead of RQ's records.

`OwnLane` blocks on the lane (one BLMOVE into the in-flight list) while the worker is ready for
turns (not paused, serving the pool's weights, healthy, not stopping) and the engine has room for
a turn, and admits each item to the feeder as a `workers.jobs.lane_job.LaneJob`. RQ's work loop
goes on taking the pool's shared lane and its batch queue meanwhile. A pause that arrives while
the thread blocks is seen after the take: the item goes back untouched.

`LaneBookkeeping` is the feeder's `JobBookkeeping`: RQ's for RQ jobs, and for a lane job what
RQ's would mean, on the two lists:

- done: the item leaves the in-flight list (its turns were logged and answered);
- a hand-back (second shutdown signal, the engine failed: `handback_reason`): back to the front of
  the lane, no retry spent, taken again once the worker is ready (or moved with the lane when the
  worker dies);
- a failure: queued again while it has a retry left, else each turn's server gets the error
  (`lanes.fail`); a request this engine does not serve, a refused job or a canceled one fails at
  once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import redis
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys
from pipeline.core.jobs import lanes
from schemas.turn_failure import TurnFailure
from workers.errors import JobCanceledError, NotAllowedJobError, UnsupportedRequestError
from workers.jobs.feeder import ExcInfo, Feeder, JobBookkeeping
from workers.jobs.lane_job import LaneJob
from workers.process.metrics import WorkerMetrics

log = logging.getLogger(__name__)

BLOCK_S = 10.0  # how long one take blocks (0.1 commands/s for an idle worker); pauses are checked after it
STOP_WAIT_S = 10.0  # how long stopping waits for the thread (its take is ended at once; Redis may be away)
NOT_READY_S = 0.2  # how often a worker not ready for turns looks again
REDIS_RETRY_S = 1.0


def failure_of(exc: BaseException | None) -> TurnFailure:
    if exc is None:
        return TurnFailure("failed", "failed (no error recorded)")
    return TurnFailure.of(type(exc).__name__, str(exc))


class LaneBookkeeping:
    """The feeder's bookkeeping: `rq`'s for RQ jobs; the lane's own ends for a `LaneJob`."""

    def __init__(self, rq: JobBookkeeping, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str,
                 metrics: WorkerMetrics) -> None:
        self.rq = rq
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.metrics = metrics
        # Why a failing job is handed back instead (a shutdown abort, an engine failure), or None.
        self.handback_reason: Callable[[BaseException | None], str | None] = lambda _: None

    def open(self, job: Job) -> Execution:
        if isinstance(job, LaneJob):
            return Execution(uuid.uuid4().hex, job.id, self.conn, worker_name=self.worker_id)
        return self.rq.open(job)

    def start(self, job: Job) -> int:
        if isinstance(job, LaneJob):
            return job.timeout or 0
        return self.rq.start(job)

    def finish(self, job: Job, queue: Queue, execution: Execution, exc_info: ExcInfo | None, result: Any) -> None:
        if not isinstance(job, LaneJob):
            self.rq.finish(job, queue, execution, exc_info, result)
            return
        if exc_info is None:
            lanes.done(self.conn, self.pool, self.worker_id, job.raw)
            self.metrics.job_finished(result)
            return
        exc = exc_info[1]
        if isinstance(exc, JobCanceledError):
            log.info("worker %s: lane job %s canceled", self.worker_id, job.id)
            lanes.fail(self.conn, self.pool, self.worker_id, job.raw, job.item, failure_of(exc))
            self.metrics.job_canceled()
            return
        handback = self.handback_reason(exc)
        if handback is not None and lanes.hand_back(self.conn, self.pool, self.worker_id, job.raw, job.item):
            log.warning("worker %s: lane job %s handed back: %s", self.worker_id, job.id, handback)
            self.metrics.job_handed_back()
            return
        log.error("worker %s: lane job %s failed", self.worker_id, job.id, exc_info=exc_info)
        refused = isinstance(exc, UnsupportedRequestError | NotAllowedJobError)
        if not refused and job.item.retries_left > 0 and \
                lanes.retry(self.conn, self.pool, self.worker_id, job.raw, job.item):
            self.metrics.job_failed(retried=True)
            return
        lanes.fail(self.conn, self.pool, self.worker_id, job.raw, job.item, failure_of(exc))
        self.metrics.job_failed()


class OwnLane:
    """A thread admitting the items of `worker_id`'s own lane to `feeder` while `ready()`."""

    def __init__(self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, feeder: Feeder, *,
                 ready: Callable[[], bool], block_s: float = BLOCK_S) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.feeder = feeder
        self.ready = ready
        self.block_s = block_s
        self.shared_lane = Queue(pool.lane_queue_name, connection=conn, serializer=JSONSerializer)
        # The takes' own connection, so that `stop` can end a take at once (CLIENT UNBLOCK).
        self._taker = redis.Redis(connection_pool=conn.connection_pool, single_connection_client=True)
        self._taker_id: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="own-lane", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Take nothing more: a take under way ends at once; an item being admitted still is."""
        self._stop.set()
        taker = self._taker_id
        if taker is not None:
            with contextlib.suppress(redis.RedisError):  # Redis gone: the take fails on its own
                self.conn.client_unblock(taker)
        self._thread.join(timeout=STOP_WAIT_S)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.ready():
                    self._stop.wait(NOT_READY_S)
                    continue
                self.feeder.wait_for_room(self._stop.is_set)
                if self._taker_id is None:
                    self._taker_id = self._taker.client_id()
                if self._stop.is_set():  # asked before its id was known: no take to end
                    break
                raw = lanes.take(self._taker, self.pool, self.worker_id, self._block_s())
                if raw is not None:
                    self._admit(raw)
            except redis.RedisError as exc:
                self._taker_id = None  # a new connection, a new id
                if self._stop.is_set():
                    break
                log.warning("worker %s: its own lane is unreachable (%s); trying again", self.worker_id, exc)
                self._stop.wait(REDIS_RETRY_S)
                self._reclaim()
            except Exception:  # never let the lane stop for one bad item
                log.exception("worker %s: taking from its own lane failed", self.worker_id)
                self._stop.wait(REDIS_RETRY_S)
        with contextlib.suppress(redis.RedisError):
            self._taker.close()

    def _reclaim(self) -> None:
        """After a take whose reply was lost (a read that timed out, a dropped connection), Redis may
        have moved an item into the in-flight list that reached no one: every item there that the
        feeder does not hold goes back to the front of the lane. Only this thread takes, so an item
        in flight and not held is such an item (a finished one leaves the list before the feeder)."""
        try:
            held = {job.raw for job, _ in self.feeder.jobs() if isinstance(job, LaneJob)}
            for raw in self.conn.lrange(self.pool.turn_lane_in_flight(self.worker_id), 0, -1):
                if raw not in held:
                    lanes.hand_back(self.conn, self.pool, self.worker_id, raw, lanes.LaneItem.decode(raw))
                    log.warning("worker %s: an item of its own lane taken as a read failed was put back",
                                self.worker_id)
        except Exception as exc:  # Redis still away (looked at again after the next failure), or an odd item
            log.warning("worker %s: its in-flight list not looked at (%s)", self.worker_id, exc)

    def _block_s(self) -> float:
        """How long a take blocks: half the connection's read timeout at most (RQ sets one on the
        worker's pool: 11 s with a 1 s maintenance interval), so that a reply read late by a busy
        worker process is no TimeoutError."""
        read_timeout = self.conn.connection_pool.connection_kwargs.get("socket_timeout")
        return self.block_s if not read_timeout else max(0.1, min(self.block_s, read_timeout / 2))

    def _admit(self, raw: bytes) -> None:
        try:
            job = LaneJob.of(raw, self.shared_lane)
        except (ValueError, TypeError, KeyError) as exc:  # not an item a server of this project wrote
            log.error("worker %s: dropped an unreadable item of its own lane (%s): %.200r", self.worker_id, exc, raw)
            lanes.done(self.conn, self.pool, self.worker_id, raw)
            return
        if self._stop.is_set() or not self.ready():  # paused (or stopping) while the take blocked
            lanes.hand_back(self.conn, self.pool, self.worker_id, raw, job.item)
            return
        try:
            self.feeder.admit(job, self.shared_lane)  # a failure once it is in flight ends it there
        except Exception as exc:  # before it was in flight: nothing else would end it
            lanes.fail(self.conn, self.pool, self.worker_id, raw, job.item, failure_of(exc))
            raise
