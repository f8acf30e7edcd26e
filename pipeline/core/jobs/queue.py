"""A pool's rollout queue and the data of the one job function workers run.

Submit builds each job with `job_data` and enqueues it on `rollout_queue`; workers take it from
there and run `JOB_FUNCTION` (referenced by name, so the trainer's side never imports `workers`).
Job ids, arguments and metadata are JSON (RQ's JSON serializer); never pickle.
"""

from __future__ import annotations

from typing import Any

import redis
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys
from schemas.capabilities import Needs
from schemas.job_payload import JobPayload

# The one job function workers run; referenced by name so `pipeline` never imports `workers`.
JOB_FUNCTION = "workers.jobs.batch_job.run_rollout_batch"
# A failed job's retries wait 1, 2, 4 ... s (at most a minute): a fault that outlasted the
# worker's own retries (a shard write is retried for a minute first) gets time to clear before
# the engine runs the batch again. Workers enqueue due retries (`workers.jobs.maintenance`).
RETRY_BACKOFF_S = 1
RETRY_BACKOFF_CAP_S = 60

RESULT_TTL_S = 7 * 24 * 3600
# Prompt ids stored beside their job (`pipeline:prompts:<job id>`) outlive any job that is still
# queued or retried in this time; a worker that finds them gone fails the job saying so.
PROMPTS_TTL_S = 30 * 24 * 3600


def retry_intervals(retries: int) -> list[int]:
    """Seconds before each retry, first to last (RQ takes the list's tail when retries are left)."""
    return [min(RETRY_BACKOFF_CAP_S, RETRY_BACKOFF_S * 2**i) for i in range(retries)]


def job_data(payload: JobPayload, *, timeout_s: int, retries: int, needs: Needs, description: str,
             meta: dict[str, Any] | None = None) -> Any:
    """RQ's data for one job of the project's job function (`Queue.enqueue_many` takes a list of them)."""
    return Queue.prepare_data(
        JOB_FUNCTION,
        args=(payload.as_json(),),
        job_id=payload.job_id,
        timeout=timeout_s,
        result_ttl=RESULT_TTL_S,
        failure_ttl=RESULT_TTL_S,
        description=description,
        retry=Retry(max=retries, interval=retry_intervals(retries)) if retries else None,
        # What the job needs of its worker, read before it runs (`workers.jobs.admission`).
        meta={**(meta or {}), "run": payload.run, "needs": needs.as_dict()},
    )


def rollout_queue(conn: redis.Redis, pool: str | None = None) -> Queue:
    """The pool's RQ queue (`pipeline.core.broker.keys.pool`)."""
    return Queue(keys.pool(pool).queue_name, connection=conn, serializer=JSONSerializer)
