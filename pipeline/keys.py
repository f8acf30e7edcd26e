"""Names of the Redis keys and RQ queues the pipeline uses, in one place."""

from __future__ import annotations

PREFIX = "pipeline"
QUEUE_NAME = "rollouts"


def commit_log(run: str) -> str:
    """The per-run Redis stream of committed shards."""
    return f"{PREFIX}:commits:{run}"


def run_jobs(run: str) -> str:
    """A hash of job id → `rows tokens weight_version` of the job's latest commit."""
    return f"{PREFIX}:run:{run}:jobs"


def run_totals(run: str) -> str:
    """A hash of a run's committed totals: shards, rows, tokens, and shards per weight version
    (`shards_v<N>`), kept by `pipeline.commit_log.append`."""
    return f"{PREFIX}:run:{run}:totals"


def batch(batch_id: str) -> str:
    """A hash describing one submitted batch (run, output, job ids)."""
    return f"{PREFIX}:batch:{batch_id}"


def run_batches(run: str) -> str:
    """The set of batch ids submitted to a run."""
    return f"{PREFIX}:run:{run}:batches"


RUNS = f"{PREFIX}:runs"
WORKERS = f"{PREFIX}:workers"


def worker(worker_id: str) -> str:
    """A worker's registry entry (a JSON string with a TTL refreshed by its heartbeat)."""
    return f"{PREFIX}:worker:{worker_id}"


CONTROL_STATE = f"{PREFIX}:control:state"
CONTROL_CHANNEL = f"{PREFIX}:control:wake"


def weight_acks(version: int) -> str:
    """A hash of worker id → acknowledgement (JSON) of a push of weight `version`."""
    return f"{PREFIX}:control:acks:{version}"


def prompts(job_id: str) -> str:
    """A job's prompt token ids as raw little-endian bytes (the fast submit path)."""
    return f"{PREFIX}:prompts:{job_id}"
