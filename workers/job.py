"""The project's job function: run one batch of requests and commit its shard."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rq import get_current_job

from pipeline import commit_log
from schemas.job import JobPayload
from workers import context
from workers.contracts import check_request_supported
from workers.rows import RowContext, build_table, utc_from_ms
from workers.shard_writer import write_shard


def run_rollout_batch(payload: dict[str, Any]) -> dict[str, Any]:
    """Generate every request of the job, write its shard, append the commit; return a summary."""
    ctx = context.current()
    job = JobPayload.model_validate(payload)
    requests = job.unpack()
    engine = ctx.engine
    description = engine.description
    for request in requests:
        check_request_supported(request, description.capabilities, has_tokenizer=description.has_tokenizer)

    weight_version = engine.weight_version
    started_at = datetime.now(UTC)
    outputs = engine.generate(requests)
    finished_at = datetime.now(UTC)
    table = build_table(
        requests,
        outputs,
        RowContext(
            run=job.run,
            job_id=job.job_id,
            engine=description.name,
            model=description.model,
            worker_id=ctx.worker_id,
            weight_version=weight_version,
            submitted_at=utc_from_ms(job.submitted_at_ms),
            started_at=started_at,
            finished_at=finished_at,
            num_experts=description.num_experts,
        ),
    )
    url = write_shard(table, job.output, job.run, job.job_id)
    tokens = int(table.column("completion_tokens").to_numpy().sum()) if table.num_rows else 0
    commit = commit_log.Commit(
        job_id=job.job_id,
        batch_id=job.batch_id,
        url=url,
        rows=table.num_rows,
        tokens=tokens,
        weight_version=weight_version,
    )
    rq_job = get_current_job()
    if rq_job is not None:
        commit_log.append(rq_job.connection, job.run, commit)
    return {"url": url, "rows": table.num_rows, "tokens": tokens, "weight_version": weight_version,
            "seconds": (finished_at - started_at).total_seconds()}
