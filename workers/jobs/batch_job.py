"""The project's job: run one batch of requests and commit its shard.

A worker runs it in two halves around the engine, so that it can keep several jobs in flight
(`workers.jobs.feeder`): `prepare_batch` (validate, unpack, capability checks, note the weights)
and `commit_batch` (rows, shard, commit log). `run_rollout_batch` is only the name RQ jobs carry
(the allow-list, `workers.jobs.allowed_job`); nothing calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from pipeline.core.broker import commit_log, keys
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest
from workers.engines.base import Engine, SampleOutput
from workers.errors import JobCanceledError, WorkerError
from workers.jobs import context
from workers.jobs.adapters import pin_adapters
from workers.jobs.turn_commits import commit_turns
from workers.rows.shard_writer import PendingShard, remove_shard
from workers.rows.table import RowContext, build_table, utc_from_ms

PROMPTS_AFTER_SUCCESS_TTL_S = 3600


@dataclass
class PreparedBatch:
    """A validated job, ready for the engine."""

    job: JobPayload
    requests: list[RolloutRequest]
    engine: Engine
    worker_id: str
    weight_version: int
    started_at: datetime


def prepare_batch(payload: dict[str, Any], conn: redis.Redis | None = None) -> PreparedBatch:
    """Validate the payload and every request against this worker's engine; note the weights."""
    ctx = context.current()
    job = JobPayload.model_validate(payload)
    check_not_canceled(conn, job)
    prompt_bytes = None
    if job.prompt_key is not None:
        if conn is None:
            raise WorkerError(f"job {job.job_id}: prompt ids live in Redis but no connection was given")
        if job.prompt_key != keys.prompts(job.job_id):
            raise WorkerError(f"job {job.job_id}: prompt key {job.prompt_key!r} is not this job's")
        prompt_bytes = conn.get(job.prompt_key)
        if prompt_bytes is None:
            check_not_canceled(conn, job)  # a cancel deletes the prompt ids of the jobs it removes
            raise WorkerError(
                f"job {job.job_id}: its prompt token ids ({job.prompt_key}) are gone from Redis "
                "(expired or deleted); submit the requests again"
            )
    requests = job.unpack(prompt_bytes)
    engine = ctx.engine  # what the requests need of it was checked when the job was admitted (`admission`)
    requests = pin_adapters(requests, engine, conn, ctx.pool)
    return PreparedBatch(job, requests, engine, ctx.worker_id, engine.weight_version, datetime.now(UTC))


def check_not_canceled(conn: redis.Redis | None, job: JobPayload) -> None:
    """`JobCanceledError` if the job was canceled (`pipeline.runs.cancel`). Agent turns (`pipeline
    serve`) are not looked up: a cancel names a run's submitted jobs, never a server's jobs of turns."""
    if job.turns is not None:
        return
    if conn is not None and conn.sismember(keys.canceled(job.run), job.job_id):
        raise JobCanceledError(f"job {job.job_id} of run {job.run} was canceled; nothing was written")


def commit_batch(
    batch: PreparedBatch, outputs: list[list[SampleOutput]], conn: redis.Redis | None,
    finished_at: datetime | None = None,
) -> dict[str, Any]:
    """Rows (contracts checked), the shard (atomic), the commit-log entry; return the job's summary."""
    job = batch.job
    description = batch.engine.description
    finished_at = finished_at or datetime.now(UTC)
    table = build_table(
        batch.requests,
        outputs,
        RowContext(
            run=job.run,
            job_id=job.job_id,
            engine=description.name,
            model=description.model,
            worker_id=batch.worker_id,
            weight_version=batch.weight_version,
            submitted_at=utc_from_ms(job.submitted_at_ms),
            started_at=batch.started_at,
            finished_at=finished_at,
            num_experts=description.num_experts,
            turns=job.turns,
        ),
    )
    if job.turns is not None:  # agent turns: each logged with many others, answered at once (`turn_log`)
        if conn is None:
            raise WorkerError(f"job {job.job_id}: agent turns need a Redis connection to answer")
        return commit_turns(job, batch.requests, table, conn)
    rows = table.num_rows
    tokens = int(table.column("completion_tokens").to_numpy().sum()) if rows else 0
    prompt_tokens = int(table.column("prompt_tokens").to_numpy().sum()) if rows else 0
    # The oldest version of any token in the shard (the job's only one in drain mode).
    oldest = int(table.column("weight_version").to_numpy().min()) if rows else batch.weight_version
    check_not_canceled(conn, job)
    shard = PendingShard.encode(table, job.output, job.run, job.job_id)
    del table  # only the encoded shard is kept (spilled to local disk if large) while storage is retried
    url = shard.store()
    commit = commit_log.Commit(
        job_id=job.job_id,
        batch_id=job.batch_id,
        url=url,
        rows=rows,
        tokens=tokens,
        weight_version=oldest,
    )
    if conn is not None:
        if not commit_log.append(conn, job.run, commit):  # canceled while the shard was written
            if not conn.hexists(keys.run_jobs(job.run), job.job_id):  # no earlier commit points at it
                remove_shard(url)
            raise JobCanceledError(f"job {job.job_id} of run {job.run} was canceled; its shard was not committed")
        if job.prompt_key is not None:
            # Done: the ids need only outlive a late duplicate of this job briefly.
            conn.expire(job.prompt_key, PROMPTS_AFTER_SUCCESS_TTL_S)
    return {"url": url, "rows": rows, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "weight_version": oldest, "seconds": (finished_at - batch.started_at).total_seconds()}


def run_rollout_batch(payload: dict[str, Any]) -> dict[str, Any]:
    """The job function every rollout job names. A `pipeline worker` runs such jobs through its
    feeder (`prepare_batch`, the engine, `commit_batch`) and never calls this."""
    raise WorkerError("rollout jobs run only inside a `pipeline worker` process, whose feeder runs them "
                      "(workers.jobs.feeder); this function is only the name RQ jobs carry")
