"""`pipeline status`: queues, workers, weight versions, runs, shards and failures."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import redis
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from pipeline import commit_log, control, keys, registry
from pipeline.submit import rollout_queue
from schemas.control import DesiredState

FAILURES_SHOWN = 20


def failure_reason(conn: redis.Redis, job_id: str) -> str:
    """The last line of a failed job's error (abandoned jobs say `AbandonedJobError`)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        result = job.latest_result()
    except Exception:  # an expired or unreadable record
        return "job record is gone from Redis"
    text = (result.exc_string if result is not None and result.exc_string else "") or ""
    return text.strip().splitlines()[-1] if text.strip() else f"{job.get_status() or 'failed'} (no error recorded)"


def _desired(conn: redis.Redis) -> dict[str, Any]:
    try:
        return control.read_state(conn).model_dump()
    except control.ControlAuthError as exc:
        return {**DesiredState().model_dump(), "error": str(exc)}


def collect(conn: redis.Redis, run: str | None = None) -> dict[str, Any]:
    queue = rollout_queue(conn)
    failed = FailedJobRegistry(queue=queue, serializer=JSONSerializer)
    started = StartedJobRegistry(queue=queue, serializer=JSONSerializer)
    runs = [run] if run else sorted(m.decode() for m in conn.smembers(keys.RUNS))
    run_stats = {}
    for name in runs:
        run_stats[name] = dataclasses.asdict(commit_log.totals(conn, name))
    now = time.time()
    # Counts and ids without RQ's cleanup: looking at the status must not retry abandoned jobs.
    failed_ids = failed.get_job_ids(0, FAILURES_SHOWN - 1, cleanup=False)
    return {
        "desired": _desired(conn),
        "queue": {"name": queue.name, "queued": queue.count, "started": started.get_job_count(cleanup=False),
                  "failed": failed.get_job_count(cleanup=False)},
        "workers": [
            {**w.model_dump(), "heartbeat_age_s": round(now - w.heartbeat_at, 1)}
            for w in registry.live_workers(conn)
        ],
        "runs": run_stats,
        "failed_jobs": failed_ids,
        "failure_reasons": {job_id: failure_reason(conn, job_id) for job_id in failed_ids},
    }


def format_status(status: dict[str, Any]) -> str:
    q = status["queue"]
    desired = status["desired"]
    lines = [
        f"desired: {'paused' if desired['paused'] else 'running'}, weights v{desired['weight_version']}"
        + (f" from {desired['weight_path']}" if desired["weight_path"] else "")
        + f" (generation {desired['generation']})",
        f"queue {q['name']}: {q['queued']} queued, {q['started']} running, {q['failed']} failed",
    ]
    workers = status["workers"]
    lines.append(f"workers: {len(workers)} live")
    for w in workers:
        caps = w["capabilities"]
        lines.append(
            f"  {w['worker_id']}  {w['state']:<9} engine={w['engine']} weights=v{w['weight_version']}"
            f" job={w['current_job'] or '-'} heartbeat={w['heartbeat_age_s']}s ago"
            f" top_logprobs<={caps['max_top_logprobs']} routed_experts={caps['routed_experts']}"
            + (f" error={w['error']}" if w.get("error") else "")
        )
    lines.append(f"runs: {len(status['runs'])}")
    for name, r in status["runs"].items():
        lines.append(
            f"  {name}: {r['shards']} shards, {r['rows']} rows, {r['tokens']} completion tokens, "
            f"weights {r['weight_versions']}"
        )
    if desired.get("error"):
        lines.insert(1, f"  REFUSED: {desired['error']}")
    if status["failed_jobs"]:
        lines.append("failed jobs: " + ", ".join(status["failed_jobs"]))
        reasons = status.get("failure_reasons", {})
        lines += [f"  {job_id}: {reasons[job_id]}" for job_id in status["failed_jobs"] if job_id in reasons]
    return "\n".join(lines)
