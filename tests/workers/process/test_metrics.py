"""Worker observability: the Prometheus endpoint scraped while a worker runs, and the JSON log format.

In-process burst workers on the real Redis (the fake engine: one job at a time; the sim engine:
jobs fed concurrently and finished on the feeder's thread), and one `pipeline worker` process.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

import pipeline
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from workers.engines.base import SampleOutput
from workers.engines.fake import FakeEngine
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.errors import EngineUnavailableError
from workers.process.worker import RolloutWorker
from workers.runtime import logs

JOBS = 4
PER_JOB = 2
NEW_TOKENS = 40
PROMPT = [1, 2, 3]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample named `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


def requests(prefix: str) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
            for i in range(JOBS * PER_JOB)]


def slow_engine(kind: str) -> FakeEngine | SimEngine:
    if kind == "fake":
        return FakeEngine(delay_s=0.15)
    # Every sequence runs to max_new_tokens (median far above it); 2 sequences at once: one job at a time.
    return SimEngine(SimConfig(capacity=PER_JOB, step_s=0.004, median_tokens=10_000, p99_tokens=10_001))


@pytest.mark.parametrize("kind", ["fake", "sim"])
def test_scraping_a_running_worker_sees_the_counters_move(
    kind: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(requests("r"), run="metrics", output=f"file://{tmp_path}", batch_size=PER_JOB)
    engine = slow_engine(kind)
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.1, metrics_port=0)
    try:
        assert worker.metrics.port and worker.metrics.host == "127.0.0.1"  # loopback unless told otherwise
        url = worker.metrics.url
        assert url == f"http://127.0.0.1:{worker.metrics.port}/metrics"
        before = scrape(url)
        labels = {"worker": worker.worker_id, "engine": engine.description.name}
        assert value(before, "pipeline_worker_rollouts_total", **labels) == 0
        assert value(before, "pipeline_worker_weight_version", **labels) == 0
        assert value(before, "pipeline_worker_state", state="starting", **labels) == 1
        # Pushed while no worker is live: this one loads it at start, between batches.
        client.push_weights("/ckpt/v3", version=3, timeout=0)

        during: list[Samples] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                during.append(scrape(url))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
        finally:
            stop.set()
            watcher.join(timeout=10)
        after = scrape(url)
    finally:
        worker.metrics.close()
        close = getattr(engine, "close", None)
        if close is not None:
            close()

    assert batch.wait(timeout=5).counts["finished"] == JOBS
    finished = [value(s, "pipeline_worker_jobs_total", outcome="finished", **labels) for s in during]
    assert finished == sorted(finished), "a counter went down"
    assert any(0 < f < JOBS for f in finished), f"no scrape saw the run in progress: {finished}"
    assert any(value(s, "pipeline_worker_state", state="busy", **labels) == 1 for s in during)

    rows = JOBS * PER_JOB
    assert value(after, "pipeline_worker_jobs_total", outcome="finished", **labels) == JOBS
    assert value(after, "pipeline_worker_jobs_total", outcome="failed", **labels) == 0
    assert value(after, "pipeline_worker_jobs_total", outcome="retried", **labels) == 0
    assert value(after, "pipeline_worker_jobs_total", outcome="handed_back", **labels) == 0
    assert value(after, "pipeline_worker_rollouts_total", **labels) == rows
    assert value(after, "pipeline_worker_completion_tokens_total", **labels) == rows * NEW_TOKENS
    assert value(after, "pipeline_worker_prompt_tokens_total", **labels) == rows * len(PROMPT)
    assert value(after, "pipeline_worker_weight_version", **labels) == 3
    assert value(after, "pipeline_worker_batch_seconds_count", **labels) == JOBS
    assert value(after, "pipeline_worker_batch_seconds_sum", **labels) >= JOBS * 0.1
    assert value(after, "pipeline_worker_queue_wait_seconds_count", **labels) == JOBS
    assert value(after, "pipeline_worker_engine_errors_total", source="job", **labels) == 0
    states = {dict(ls)["state"]: v for (n, ls), v in after.items() if n == "pipeline_worker_state"}
    assert sum(states.values()) == 1 and set(states) >= {"idle", "busy", "paused", "updating", "unhealthy"}


def test_failed_jobs_are_counted(redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")  # no worker serves top-3: fail at once
    client = pipeline.Client(redis_client)
    refused = client.submit([{"id": "x", "input_ids": [1], "logprobs": 3}], run="bad", output=f"file://{tmp_path}")
    client.submit([{"id": "boom", "input_ids": [1]}], run="bad", output=f"file://{tmp_path}")
    worker = RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0, fail_ids={"boom"}))
    worker.work(burst=True, with_scheduler=False, logging_level="CRITICAL")
    registry = worker.metrics.registry
    labels = {"worker": worker.worker_id, "engine": "fake"}
    # The engine's failure: two retries (after their backoff), then failed for good. The refused
    # request (top-3 logprobs on a worker allowing none) fails at once: a retry would be refused too.
    assert "UnservableJobError" in refused.failures()[refused.job_ids[0]]
    assert registry.get_sample_value("pipeline_worker_jobs_total", {**labels, "outcome": "retried"}) == 2
    assert registry.get_sample_value("pipeline_worker_jobs_total", {**labels, "outcome": "failed"}) == 2
    assert registry.get_sample_value("pipeline_worker_jobs_total", {**labels, "outcome": "finished"}) == 0


class FailsOnce(FakeEngine):
    """An engine that is unreachable for its first batch."""

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        if not self.calls:
            self.calls.append([])
            raise EngineUnavailableError("engine unreachable")
        return super().generate(requests)


def test_engine_errors_and_hand_backs_are_counted(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(requests("e")[:1], run="flaky", output=f"file://{tmp_path}")
    worker = RolloutWorker(redis_client, FailsOnce(), probe_max_s=0.05)
    worker.work(burst=True, with_scheduler=False, logging_level="CRITICAL")
    assert batch.wait(timeout=5).counts["finished"] == 1
    registry = worker.metrics.registry
    labels = {"worker": worker.worker_id, "engine": "fake"}
    assert registry.get_sample_value("pipeline_worker_engine_errors_total", {**labels, "source": "job"}) == 1
    for outcome, count in {"handed_back": 1, "finished": 1, "failed": 0, "retried": 0}.items():
        assert registry.get_sample_value("pipeline_worker_jobs_total", {**labels, "outcome": outcome}) == count


@pytest.mark.parametrize("kind", ["fake", "sim"])
def test_json_logs_name_the_job_on_every_job_line(kind: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(requests("j")[:4], run="logs", output=f"file://{tmp_path}", batch_size=PER_JOB)
    engine = slow_engine(kind)
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.1)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.JobContextFilter())
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        worker.work(burst=True, with_scheduler=False, logging_level="INFO")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    assert batch.wait(timeout=5).counts["finished"] == 2
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines and all(set(e) >= {"time", "level", "logger", "message", "worker", "job_id", "run"} for e in lines)
    for job_id in batch.job_ids:
        done = [e for e in lines if job_id in e["message"] and "Job OK" in e["message"]]
        assert done, f"no completion line for {job_id}"
        assert all(e["job_id"] == job_id and e["run"] == "logs" and e["worker"] == worker.worker_id for e in done)
    # Lines that name a job in their message, logged while it was processed, carry it as a field too.
    for e in lines:
        named = [j for j in batch.job_ids if j in e["message"]]
        if e["job_id"] is not None:
            assert e["run"] == "logs" and e["job_id"] in batch.job_ids
        elif named and "Job OK" in e["message"]:
            pytest.fail(f"job line without its job: {e}")
    # Outside any job (start, shutdown) the fields are null; the scope never leaks.
    assert any(e["job_id"] is None for e in lines)
    assert logs.current_job() is None


def test_cli_worker_json_logs_and_metrics_port(pipeline_env: dict[str, str], tmp_path: Path) -> None:
    env = {**pipeline_env, "PIPELINE_LOG_FORMAT": "json", "PIPELINE_METRICS_PORT": "0"}
    client = pipeline.connect(env["PIPELINE_REDIS_URL"])
    batch = client.submit(requests("c")[:2], run="cli", output=f"file://{tmp_path}", batch_size=PER_JOB)
    proc = subprocess.run(
        [*PIPELINE, "worker", "--engine", "sim", "--burst", "--worker-id", "w-json", "--sim-step-ms", "0",
         "--maintenance-interval", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert batch.wait(timeout=5).counts["finished"] == 1
    assert proc.stdout.strip() == ""  # in json mode nothing but JSON lines, all on stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]
    assert all(e["worker"] == "w-json" for e in lines)
    [job_id] = batch.job_ids
    assert any(e["job_id"] == job_id and e["run"] == "cli" for e in lines)
    started = [e for e in lines if "metrics=http://127.0.0.1:" in e["message"]]
    assert started, "the start line names the metrics endpoint"
