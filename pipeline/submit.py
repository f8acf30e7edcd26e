"""Submitting requests: group into batch jobs and enqueue them all in one Redis transaction."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from pipeline import keys, registry
from pipeline.capabilities import check_requests
from pipeline.errors import PipelineError
from pipeline.redis_server import state_dir
from pipeline.request_file import ParsedRequest
from pipeline.security import check_output_url
from schemas.job import JobHeader, JobPayload
from schemas.request import RolloutRequest

# The one job function workers run; referenced by name so `pipeline` never imports `workers`.
JOB_FUNCTION = "workers.job.run_rollout_batch"
DEFAULT_BATCH_SIZE = 64
DEFAULT_JOB_TIMEOUT_S = 6 * 3600
DEFAULT_RETRIES = 2
RESULT_TTL_S = 7 * 24 * 3600
# Prompt ids stored beside their job (`pipeline:prompts:<job id>`) outlive any job that is still
# queued or retried in this time; a worker that finds them gone fails the job saying so.
PROMPTS_TTL_S = 30 * 24 * 3600
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_output() -> str:
    return os.environ.get("PIPELINE_OUTPUT") or f"file://{state_dir() / 'shards'}"


def new_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


@dataclass(frozen=True)
class SubmitPlan:
    """What a submit enqueued: enough to wait for and read the batch back."""

    batch_id: str
    run: str
    output: str
    job_ids: list[str]
    requests: int
    samples: int


def rollout_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.QUEUE_NAME, connection=conn, serializer=JSONSerializer)


def submit_requests(
    conn: redis.Redis,
    requests: Sequence[RolloutRequest | ParsedRequest],
    *,
    run: str | None = None,
    output: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    min_weight_version: int | None = None,
    job_timeout_s: int = DEFAULT_JOB_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
) -> SubmitPlan:
    """Enqueue all requests as jobs of at most `batch_size`, atomically (all or none).

    Each job's prompt ids go to their own Redis key as raw bytes, written in the same MULTI/EXEC
    as the jobs, instead of base64 inside the job data (which RQ zlib-compresses, slowly and to
    little effect). `requests` may be models or
    `ParsedRequest`s (`pipeline.request_file.read_request_lines`), whose ids are packed as arrays.
    """
    if not requests:
        raise PipelineError("nothing to submit: no requests")
    if batch_size < 1:
        raise PipelineError(f"--batch-size must be at least 1, not {batch_size}")
    run = run or new_run_name()
    if not _RUN_NAME.match(run):
        raise PipelineError(
            f"run name {run!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it becomes a directory name)"
        )
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        raise PipelineError("request ids must be unique within a submit")
    output = (output or default_output()).rstrip("/")
    check_output_url(output)  # the default output too: a worker would refuse it anyway
    check_requests(requests, registry.live_workers(conn))

    batch_id = uuid.uuid4().hex[:12]
    submitted_at_ms = int(time.time() * 1000)
    queue = rollout_queue(conn)
    job_datas = []
    job_ids = []
    prompts: dict[str, bytes] = {}
    for index, start in enumerate(range(0, len(requests), batch_size)):
        chunk = requests[start : start + batch_size]
        job_id = f"{batch_id}-{index:05d}"
        common = JobHeader(run=run, job_id=job_id, batch_id=batch_id, output=output,
                           submitted_at_ms=submitted_at_ms, min_weight_version=min_weight_version)
        key = keys.prompts(job_id)
        payload, prompts[key] = JobPayload.pack_beside(chunk, prompt_key=key, **common)
        job_ids.append(job_id)
        job_datas.append(
            Queue.prepare_data(
                JOB_FUNCTION,
                # The request dicts are plain JSON already (validated lines): not walked again.
                args=({**payload.model_dump(mode="json", exclude={"requests"}), "requests": payload.requests},),
                job_id=job_id,
                timeout=job_timeout_s,
                result_ttl=RESULT_TTL_S,
                failure_ttl=RESULT_TTL_S,
                description=f"rollouts run={run} job={index} requests={len(chunk)}",
                retry=Retry(max=retries) if retries else None,
                meta={"batch_id": batch_id, "run": run},
            )
        )
    samples = sum(r.n if isinstance(r, ParsedRequest) else r.sampling_params.n for r in requests)
    with conn.pipeline(transaction=True) as pipe:
        for key, value in prompts.items():
            pipe.set(key, value, ex=PROMPTS_TTL_S)
        queue.enqueue_many(job_datas, pipeline=pipe)
        pipe.hset(
            keys.batch(batch_id),
            mapping={
                "run": run,
                "output": output,
                "job_ids": ",".join(job_ids),
                "requests": len(requests),
                "samples": samples,
                "submitted_at_ms": submitted_at_ms,
            },
        )
        pipe.sadd(keys.run_batches(run), batch_id)
        pipe.sadd(keys.RUNS, run)
        pipe.execute()
    return SubmitPlan(batch_id, run, output, job_ids, len(requests), samples)
