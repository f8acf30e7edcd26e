"""A second SIGTERM hands the jobs in flight back: one log line each, not an ERROR with a
`CancelledError` traceback per job (real redis-server, real `pipeline worker` process, its stderr)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.core.broker import registry
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from tests.helpers.processes import log_tail, wait_until

# Sequences that would decode for minutes: only the second signal ends them.
SIM = ["--engine", "sim", "--sim-capacity", "16", "--sim-step-ms", "50", "--sim-median-tokens", "4000",
       "--sim-p99-tokens", "4001", "--heartbeat-interval", "0.5", "--log-level", "INFO"]


def test_a_second_sigterm_logs_one_line_per_job_handed_back(
        redis_client: redis.Redis, pipeline_env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([*PIPELINE, "worker", *SIM, "--pool", "abort"], env=pipeline_env,
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        wait_until(lambda: len(registry.live_workers(redis_client, "abort")) == 1, 60, "the worker to register")
        requests = [RolloutRequest(id=f"s{i}", input_ids=[1, 2], sampling_params={"max_new_tokens": 4000})
                    for i in range(6)]
        batch = Batch(redis_client, submit_requests(redis_client, requests, run="abort", pool="abort",
                                                    output=f"file://{tmp_path}/shards", batch_size=2))
        wait_until(lambda: list(batch.job_states().values()) == ["started"] * 3, 60, "three jobs in flight")
        worker.send_signal(signal.SIGTERM)
        wait_until(lambda: "warm shut down requested" in log.read_text(), 30, "the first signal's effect")
        first = time.monotonic()
        wait_until(lambda: time.monotonic() - first > 1.1, 5, "RQ's one-second repeat window to pass")
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)  # the sequences would run for minutes: an exit means they were aborted
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    for job_id in batch.job_ids:
        job = Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)
        assert (job.get_status(), job.meta.get("handed_back")) == ("queued", 1), job_id
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, log_tail(log)
    handed_back = [line for line in text.splitlines() if "handed back to queue" in line]
    assert sorted(line.split("job ")[1].split()[0] for line in handed_back) == sorted(batch.job_ids), log_tail(log)
