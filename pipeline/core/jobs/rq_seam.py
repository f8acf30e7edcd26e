"""Every use of RQ beyond its documented API, in one place.

The worker builds on RQ's `SimpleWorker` and the pinned RQ minor (`RQ_MINOR`, pinned in
pyproject.toml). Outside this module the worker code only overrides the RQ methods listed in
`OVERRIDDEN` and calls the undocumented ones listed in `CALLED`; the private methods and
attributes it needs are reached through the functions below. `tests/pipeline/core/jobs/test_rq_seam.py`
fails when the installed RQ lacks any of them or their parameters changed, and when a worker
class overrides an RQ method that is not listed here.

Upgrading RQ: read each listed method in the new release (what the overrides and callers here
rely on), adjust, update the parameter lists and the pin.
"""

from __future__ import annotations

import time
from datetime import datetime
from types import TracebackType
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker

RQ_MINOR = "3.0"

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]

# RQ worker methods the project's worker classes override, with their parameters in RQ_MINOR.
OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "_finalize_success": ("self", "job", "queue", "execution", "return_value"),
    "_shutdown": ("self",),
    "clean_group_registries": ("self",),
    "clean_registries": ("self",),
    "dequeue_job_and_maintain_ttl": ("self", "timeout", "max_idle_time"),
    "execute_job": ("self", "job", "queue"),
    "get_heartbeat_ttl": ("self", "job", "working_time"),
    "handle_exception": ("self", "job", "exc_info"),
    "heartbeat": ("self", "timeout", "pipeline"),  # sent at most every few seconds (`EngineWorker.heartbeat`)
    "handle_job_failure": ("self", "job", "queue", "started_job_registry", "exc_string", "execution"),
    "procline": ("self", "message"),
    "request_force_stop": ("self", "signum", "frame"),
    "request_stop": ("self", "signum", "frame"),
    "set_state": ("self", "state", "pipeline"),  # written only when it changes
    "unsubscribe": ("self",),  # RQ's joins its pub/sub thread without a timeout (`EngineWorker.unsubscribe`)
    "work": ("self", "burst", "logging_level", "date_format", "log_format", "max_jobs", "max_idle_time",
             "with_scheduler", "dequeue_strategy"),
}

# Undocumented (internal but not underscored) worker methods the project calls.
CALLED: dict[str, tuple[str, ...]] = {
    "prepare_execution": ("self", "job"),
    "prepare_job_execution": ("self", "job", "remove_from_intermediate_queue"),
    "cleanup_execution": ("self", "job", "pipeline", "execution"),
    "maintain_heartbeats": ("self", "job", "execution"),
}

# Private methods reached through the functions below: (class, name) -> parameters.
PRIVATE_METHODS: dict[tuple[type, str], tuple[str, ...]] = {
    (BaseWorker, "_finalize_success"): ("self", "job", "queue", "execution", "return_value"),
    (BaseWorker, "_finalize_failure"): ("self", "job", "queue", "execution", "exc_info"),
    (Queue, "_enqueue_job"): ("self", "job", "pipeline", "at_front", "unique"),
}

# Private attributes every RQ worker sets in __init__, read or written through the functions below.
PRIVATE_ATTRIBUTES = ("_shutdown_requested_date", "_stop_requested", "_stopped_job_id", "_exc_handlers")


def finalize_success(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, result: Any) -> None:
    """What RQ does after a job function returned (result, success registry; a `Retry` re-enqueues)."""
    worker._finalize_success(job, queue, execution, result)


def finalize_failure(worker: BaseWorker, job: Job, queue: Queue, execution: Execution, exc_info: ExcInfo) -> None:
    """What RQ does after a job function raised (exception handlers, retries, failed registry)."""
    worker._finalize_failure(job, queue, execution, exc_info)


class WorkerBookkeeping:
    """RQ's bookkeeping of `worker` around each job its `Feeder` runs (`workers.jobs.feeder.JobBookkeeping`),
    what `SimpleWorker.execute_job` and `perform_job` do around the job function."""

    def __init__(self, worker: BaseWorker) -> None:
        self.worker = worker

    def open(self, job: Job) -> Execution:
        return self.worker.prepare_execution(job)

    def start(self, job: Job) -> int:
        worker = self.worker
        worker.prepare_job_execution(job, remove_from_intermediate_queue=len(worker.queues) == 1)
        job.started_at = now()
        return job.timeout or worker.queue_class.DEFAULT_TIMEOUT

    def finish(self, job: Job, queue: Queue, execution: Execution, exc_info: ExcInfo | None, result: Any) -> None:
        if exc_info is None:
            finalize_success(self.worker, job, queue, execution, result)
        else:
            finalize_failure(self.worker, job, queue, execution, exc_info)


def enqueue(queue: Queue, job: Job, pipeline: Pipeline, *, at_front: bool) -> None:
    """Put an existing job (back) on `queue` (what RQ's own `Job.retry` and scheduler do)."""
    queue._enqueue_job(job, pipeline=pipeline, at_front=at_front)


# KEYS: the job's hash, the queue's started registry. ARGV: the execution's `job id:execution id`,
# its expiry (a timestamp), the worker's name. Only while the job is still started by that worker.
_REASSERT_STARTED = """
if redis.call('HGET', KEYS[1], 'status') == 'started' and redis.call('HGET', KEYS[1], 'worker_name') == ARGV[3] then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
end
"""


def reassert_started(conn: Redis, job: Job, execution: Execution, ttl: int) -> None:
    """Put a running execution back in its queue's started registry if a write lost in a Redis
    failover took its entry out (RQ's own heartbeat only refreshes an entry that is there), so a
    job a live worker runs is never taken for orphaned (`workers.jobs.reconcile`)."""
    conn.register_script(_REASSERT_STARTED)(
        keys=[job.key, job.started_job_registry.key],
        args=[execution.composite_key, time.time() + ttl, execution.worker_name],
    )


def shutdown_requested_at(worker: BaseWorker) -> datetime | None:
    """When the first shutdown signal arrived (None: none yet)."""
    return worker._shutdown_requested_date


def stop_requested(worker: BaseWorker) -> bool:
    """Whether the worker was asked to stop (it finishes the job in hand, then exits)."""
    return worker._stop_requested


def request_stop(worker: BaseWorker) -> None:
    """Ask the worker's loop to exit after the job in hand."""
    worker._stop_requested = True


def stopped_job_id(worker: BaseWorker) -> str | None:
    """The job a `rq job stop` command stopped on this worker (not retried), if any."""
    return worker._stopped_job_id


def exception_handlers(worker: BaseWorker) -> list[Any]:
    """The worker's exception handlers (what RQ's own registry cleaning passes on)."""
    return worker._exc_handlers
