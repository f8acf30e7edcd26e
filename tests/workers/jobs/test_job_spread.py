"""Jobs spread over workers: an hf worker (its engine runs one batch at a time) claims the job it runs
and one more, so a second worker started later runs the rest of a run already queued. Real
`pipeline worker` processes on the tiny model and the real Redis.

The first worker's engine holds its running batch after `HELD` tokens (`held_hf_worker`, until it
is killed), so it can never catch up: every job the second one does not run stays unrun, whatever
the machine's speed. The test waits on the queue and the commit log, never on sleeps."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import redis
from rq import Queue

import pipeline
from pipeline.core.broker import commit_log, keys
from tests.helpers.processes import wait_until
from tests.workers.jobs.held_hf_worker import HOLD_VARIABLE
from workers.jobs.feeder import PREFETCH_BATCHES

HELD = 2
JOBS = 6


def test_a_worker_started_later_runs_its_share_of_a_queued_run(
    redis_client: redis.Redis, tmp_path: Path, start_worker: Callable[..., subprocess.Popen]
) -> None:
    requests = [{"id": f"r{i}", "input_ids": [5, 6, 7],
                 "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}} for i in range(JOBS)]
    batch = pipeline.Client(redis_client).submit(requests, run="spread", output=f"file://{tmp_path}", batch_size=1)
    assert len(batch.job_ids) == JOBS
    queue = Queue(keys.pool(None).queue_name, connection=redis_client)
    claimed = 1 + PREFETCH_BATCHES  # the running job and the one waiting behind it
    first = start_worker("--worker-id", "first", module="tests.workers.jobs.held_hf_worker",
                         env={HOLD_VARIABLE: str(HELD)})
    try:
        wait_until(lambda: queue.count <= JOBS - claimed, 300, "the first worker to claim its jobs")
        start_worker("--worker-id", "second")
        wait_until(lambda: len(commit_log.read_all(redis_client, "spread")) >= JOBS - claimed, 300,
                   f"{JOBS - claimed} jobs committed (the first worker holds {claimed}: they cannot be)")
        commits = commit_log.read_all(redis_client, "spread")
        workers = {w for c in commits for w in pq.read_table(c.url.removeprefix("file://")).column("worker_id").to_pylist()}
        assert len(commits) == JOBS - claimed and workers == {"second"}
        assert queue.count == 0
    finally:
        first.kill()
        first.wait(timeout=30)
