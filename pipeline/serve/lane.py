"""The interactive lane: an agent turn as a job of one request in its pool's lane queue, and its answer.

Workers take the lane queue (`keys.PoolKeys.lane_queue_name`) before their pool's batch queue,
so a turn waits for a free slot in the engine, not behind a 10 000-request run. A turn is the
project's job function like any batch (same allow-list, admission, retries, hand-backs, engine
road); its payload carries a `TurnTag`, so the worker logs its rows and answers here
(`workers.jobs.turn_log`) instead of writing a shard of one row.

`wait` blocks on the turn's reply list, checking between blocks whether the job failed; past
the turn timeout it says 503 (`Retry-After`) when no live worker of the pool could take the
turn or the pool is paused, else 504. The job stays queued: the agent's retry of the same
call waits for it again instead of generating it twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.audit.status import failure_reason
from pipeline.broker import control_channel, keys, registry
from pipeline.errors import CapabilityError, PipelineError
from pipeline.intake.placement import Placement
from pipeline.intake.submit import job_data
from pipeline.serve.errors import APIError
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.shard import rows_from_ipc
from schemas.worker_info import WorkerInfo

DEFAULT_TURN_TIMEOUT_S = 600.0
TURN_JOB_TIMEOUT_S = 3600
TURN_RETRIES = 1
WORKERS_TTL_S = 1.0  # live workers are read at most this often per server
BLOCK_S = 1.0  # how long one wait blocks before checking the job's state


class Lane:
    """One pool's interactive lane, as a server uses it."""

    def __init__(self, conn: redis.Redis, pool: str, *, turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S) -> None:
        self.conn = conn
        self.keys = keys.pool(pool)
        self.turn_timeout_s = turn_timeout_s
        self.queue = Queue(self.keys.lane_queue_name, connection=conn, serializer=JSONSerializer)
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._lock = threading.Lock()

    def live_workers(self) -> list[WorkerInfo]:
        with self._lock:
            read_at, workers = self._workers
            if time.monotonic() - read_at > WORKERS_TTL_S:
                workers = registry.live_workers(self.conn, self.keys.name)
                self._workers = (time.monotonic(), workers)
            return workers

    def enqueue(self, request: RolloutRequest, *, run: str, output: str, job_id: str, turn: TurnTag) -> None:
        """Enqueue the turn; 400 when no live worker of the pool could serve what it asks."""
        placement = Placement(self.live_workers(), self.keys.name)
        needs, _ = placement.place(request, request.id)
        try:
            placement.check()
        except CapabilityError as exc:
            raise APIError(400, str(exc).replace("nothing was enqueued:\n  ", ""), code="unservable") from None
        payload = JobPayload.pack([request], run=run, job_id=job_id, batch_id=turn.session_id, output=output,
                                  submitted_at_ms=int(time.time() * 1000), turn=turn)
        data = job_data(payload, timeout_s=TURN_JOB_TIMEOUT_S, retries=TURN_RETRIES, needs=needs,
                        description=f"turn {turn.turn} of session {turn.session_id} (run {run})",
                        meta={"session_id": turn.session_id})
        self.queue.enqueue_many([data])

    def wait(self, job_id: str, started: float,
             settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        """The turn's rows, once its worker answers; or the answer `settled()` finds recorded (another
        server's waiter took the rows and recorded the turn); `APIError` for a failed or late turn."""
        reply = keys.turn_reply(job_id)
        job_key = Job.key_for(job_id)
        while True:
            left = self.turn_timeout_s - (time.monotonic() - started)
            if left <= 0:
                raise self._late(job_id)
            popped = self.conn.blpop([reply], timeout=max(0.01, min(BLOCK_S, left)))
            if popped is not None:
                return rows_from_ipc(popped[1])
            answered = settled()
            if answered is not None:
                return answered
            status = self.conn.hget(job_key, "status")
            if status in (b"failed", b"stopped", b"canceled") or status is None:
                reason = failure_reason(self.conn, job_id) if status is not None else "its job is gone from Redis"
                status_code = 400 if "cannot serve" in reason or "Unsupported" in reason else 500
                raise APIError(status_code, f"the turn failed on the worker: {reason}", code="turn_failed")

    def _late(self, job_id: str) -> APIError:
        status = (self.conn.hget(Job.key_for(job_id), "status") or b"").decode()
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
