"""What a job's record says: its RQ status, why it failed, where it came from, whether it was canceled.

RQ keeps a job as a hash (`Job.key_for`); reading one field of it in a pipeline is far cheaper than
`Job.fetch`, so the raw reads live here, once, beside the documented ones.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.client import Pipeline
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys


def job_key(job_id: str) -> str:
    """The Redis key of a job's record."""
    return Job.key_for(job_id)


def read_status(conn: redis.Redis | Pipeline, job_id: str) -> Any:
    """The job's RQ status as Redis returns it (bytes, or None once its record is gone); in a
    pipeline, queues the read."""
    return conn.hget(job_key(job_id), "status")


def read_origin(conn: redis.Redis, job_id: str) -> bytes | None:
    """The queue the job was enqueued on (its `origin` field)."""
    return conn.hget(job_key(job_id), "origin")


def failure_reason(conn: redis.Redis, job_id: str) -> str:
    """The last line of a failed job's error (abandoned jobs say `AbandonedJobError`)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        result = job.latest_result()
    except Exception:  # an expired or unreadable record
        return "job record is gone from Redis"
    text = (result.exc_string if result is not None and result.exc_string else "") or ""
    return text.strip().splitlines()[-1] if text.strip() else f"{job.get_status() or 'failed'} (no error recorded)"


def canceled_jobs(conn: redis.Redis, run: str, job_ids: list[str]) -> set[str]:
    """Which of `job_ids` (all of run `run`) are canceled."""
    if not job_ids:
        return set()
    flags = conn.smismember(keys.canceled(run), job_ids)
    return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag}
