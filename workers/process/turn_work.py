"""A job of agent turns from a worker's turn queue (`pipeline.core.jobs.turn_queue`), as the feeder
runs it (`workers.jobs.work.Work`): no RQ record, its ends on its stream entry.

- done: the entry is acknowledged (its turns were logged and answered);
- a hand-back (second shutdown signal, the engine failed: `TurnEnds.handback_reason`): the entry is
  made idle, no retry spent, and the next take-over of a live worker (this one too, once ready)
  runs it;
- a failure: queued again while it has a retry left, else each turn's server gets the error
  (`turn_queue.fail`); a request this engine does not serve, a refused job or a canceled one fails
  at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis

from pipeline.core.broker.security import check_output_url
from pipeline.core.broker.work_streams import Claimed
from pipeline.core.errors import PolicyError
from pipeline.core.jobs import turn_queue
from schemas.turn_failure import TurnFailure
from schemas.turn_job import TurnJob
from workers.errors import JobCanceledError, NotAllowedJobError, UnsupportedRequestError
from workers.jobs.work import ExcInfo
from workers.process.metrics import WorkerMetrics

log = logging.getLogger(__name__)


def failure_of(exc: BaseException | None) -> TurnFailure:
    if exc is None:
        return TurnFailure("failed", "failed (no error recorded)")
    return TurnFailure.of(type(exc).__name__, str(exc))


class TurnEnds:
    """One worker's ends of its turn jobs: what becomes of an entry after a run."""

    def __init__(self, conn: redis.Redis, worker_id: str, metrics: WorkerMetrics) -> None:
        self.conn = conn
        self.worker_id = worker_id
        self.metrics = metrics
        # Why a failing job is handed back instead (a shutdown abort, an engine failure), or None.
        self.handback_reason: Callable[[BaseException | None], str | None] = lambda _: None

    def finish(self, claimed: Claimed[TurnJob], exc_info: ExcInfo | None, result: Any) -> None:
        job = claimed.job
        if exc_info is None:
            turn_queue.done(self.conn, claimed)
            self.metrics.job_finished(result)
            return
        exc = exc_info[1]
        if isinstance(exc, JobCanceledError):
            log.info("worker %s: turn job %s canceled", self.worker_id, job.job_id)
            turn_queue.fail(self.conn, claimed, failure_of(exc))
            self.metrics.job_canceled()
            return
        handback = self.handback_reason(exc)
        if handback is not None:
            turn_queue.hand_back(self.conn, self.worker_id, claimed)
            log.warning("worker %s: turn job %s handed back: %s", self.worker_id, job.job_id, handback)
            self.metrics.job_handed_back()
            return
        log.error("worker %s: turn job %s failed", self.worker_id, job.job_id, exc_info=exc_info)
        refused = isinstance(exc, UnsupportedRequestError | NotAllowedJobError)
        if not refused and job.retries_left > 0:
            turn_queue.retry(self.conn, claimed)
            self.metrics.job_failed(retried=True)
            return
        turn_queue.fail(self.conn, claimed, failure_of(exc))
        self.metrics.job_failed()


class TurnWork:
    """A turn queue entry the feeder runs."""

    def __init__(self, claimed: Claimed[TurnJob], ends: TurnEnds, *, taken_over: bool = False) -> None:
        self.claimed = claimed
        self.ends = ends
        self.taken_over = taken_over  # another run of it may have begun (a dead worker's, a hand-back)

    @property
    def id(self) -> str:
        return self.claimed.job.job_id

    @property
    def payload(self) -> Any:
        return self.claimed.job.payload

    @property
    def enqueued_at(self) -> datetime | None:
        return datetime.fromtimestamp(self.claimed.job.enqueued_at, UTC)

    @property
    def ran_before(self) -> bool:
        return self.taken_over or self.claimed.job.attempts > 0

    def open(self) -> None:
        pass  # the group's pending list holds it already

    def start(self) -> tuple[dict[str, Any], int]:
        job = self.claimed.job
        output = job.payload.get("output")
        if isinstance(output, str):
            try:
                check_output_url(output)
            except PolicyError as exc:
                raise NotAllowedJobError(f"job {job.job_id}: {exc}; refused, nothing ran") from exc
        return job.payload, job.timeout_s

    def finish(self, exc_info: ExcInfo | None, result: Any) -> None:
        self.ends.finish(self.claimed, exc_info, result)
