"""Handing a job back to its queue without spending one of its retries.

A started job is handed back when the fault is the worker's, not the job's: a second SIGTERM
aborted it, or the engine failed under it (`hand_back_started`). The execution is removed from
the started registry and the job goes to the front of its queue for another worker. Each
hand-back is counted in the job's meta; past `max_handbacks()` the caller fails the job the
ordinary way (retries, then the failed registry), so a job that itself kills engines cannot
loop forever.

A job dequeued but never started (the pool is paused, the worker cannot serve it, or its engine
failed meanwhile) goes back untouched and uncounted (`hand_back_dequeued`).
"""

from __future__ import annotations

import logging

import redis
from rq import Queue
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.worker import BaseWorker

from pipeline.core import settings
from pipeline.core.jobs import rq_seam

log = logging.getLogger(__name__)

HANDBACKS_META = "handed_back"
REASON_META = "handed_back_reason"


def max_handbacks() -> int:
    """How often one job may be handed back before it fails like any other error."""
    return settings.max_handbacks()


def hand_back_started(
    worker: BaseWorker, job: Job, queue: Queue, execution: Execution | None, *, reason: str
) -> bool:
    """Requeue a started job at the front of `queue`; False (nothing done) past the hand-back limit."""
    count = int(job.meta.get(HANDBACKS_META, 0)) + 1
    if count > max_handbacks():
        log.warning("job %s: handed back %d times already; failing it instead (%s)", job.id, count - 1, reason)
        return False
    job.meta[HANDBACKS_META] = count
    job.meta[REASON_META] = reason[:500]
    with worker.connection.pipeline() as pipe:
        worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        job.set_status(JobStatus.QUEUED, pipeline=pipe)
        rq_seam.enqueue(queue, job, pipe, at_front=True)
        pipe.execute()
    log.warning("job %s handed back to queue %s (%d/%d): %s", job.id, queue.name, count, max_handbacks(), reason)
    return True


def hand_back_dequeued(conn: redis.Redis, job: Job, queue: Queue, *, at_front: bool) -> None:
    """Put a dequeued job back on its queue untouched (it never started)."""
    with conn.pipeline() as pipe:
        pipe.lrem(IntermediateQueue(queue.key, conn).key, 1, job.id)
        if at_front:
            pipe.lpush(queue.key, job.id)
        else:
            pipe.rpush(queue.key, job.id)
        pipe.execute()
