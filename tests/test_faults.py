"""Faults: SIGKILL and SIGTERM mid-batch, an engine that fails, a shard store that fails.

Worker processes are forked (`multiprocessing`) around fake engines on the real test Redis,
with heartbeats and maintenance on a clock of seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline.audit.status import collect
from pipeline.broker import commit_log, registry
from pipeline.errors import JobsFailedError
from pipeline.intake.submit import submit_requests
from pipeline.read.batch import Batch
from schemas.request import RolloutRequest
from tests.helpers import FlakyStore, wait_until
from workers.engines.base import SampleOutput
from workers.engines.fake import FakeEngine
from workers.engines.sim import SimConfig, SimEngine
from workers.errors import EngineUnavailableError
from workers.jobs import rq_seam
from workers.process.worker import RolloutWorker

REQUESTS = [RolloutRequest(id=f"r{i}", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2}) for i in range(3)]


class FlakyEngine(FakeEngine):
    """Down (generate and health fail) while `flag` exists."""

    def __init__(self, job_s: float, flag: Path) -> None:
        super().__init__(delay_s=job_s)
        self.flag = flag

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        if self.flag.exists():
            raise EngineUnavailableError("SGLang POST /generate failed on http://gpu:30000: connection refused")
        return super().generate(requests)

    def health(self) -> None:
        if self.flag.exists():
            raise EngineUnavailableError("GET /health_generate: connection refused")


FIRST_SIGNAL_KEY = "test:faults:first-shutdown-signal"


class SignalNoting(RolloutWorker):
    """Notes in Redis when it took its first shutdown signal (RQ's own time of it)."""

    def request_stop(self, signum: int, frame: Any) -> None:
        try:
            super().request_stop(signum, frame)
        finally:
            first = rq_seam.shutdown_requested_at(self)
            if first is not None:
                self.connection.set(FIRST_SIGNAL_KEY, first.timestamp())


def _serve(url: str, job_s: float, flag: str | None, slow_sim: bool = False) -> None:
    from pipeline.broker.connection import connect_redis

    if slow_sim:  # a concurrent engine (several jobs in flight) whose sequences take minutes
        engine: Any = SimEngine(SimConfig(capacity=16, step_s=0.05, median_tokens=4000, p99_tokens=4001))
    else:
        engine = FlakyEngine(job_s, Path(flag)) if flag else FakeEngine(delay_s=job_s)
    worker = SignalNoting(connect_redis(url), engine, heartbeat_interval_s=0.5, maintenance_interval_s=1,
                          stuck_after_s=3, probe_max_s=0.5, control_poll_s=0.5)
    worker.work(burst=False, with_scheduler=False, logging_level="WARNING")


@pytest.fixture
def spawn(redis_url: str) -> Iterator[Callable[..., mp.process.BaseProcess]]:
    processes: list[mp.process.BaseProcess] = []

    def start(job_s: float = 0.05, flag: Path | None = None, slow_sim: bool = False) -> mp.process.BaseProcess:
        process = mp.get_context("fork").Process(
            target=_serve, args=(redis_url, job_s, str(flag) if flag else None, slow_sim), daemon=True)
        process.start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        process.join()




def _submit(conn: redis.Redis, tmp_path: Path, *, retries: int = 2, run: str = "faults") -> Batch:
    plan = submit_requests(conn, REQUESTS, run=run, output=f"file://{tmp_path}", batch_size=10, retries=retries)
    return Batch(conn, plan)


def _job(conn: redis.Redis, batch: Batch) -> Job:
    return Job.fetch(batch.job_ids[0], connection=conn, serializer=JSONSerializer)


def _sigterm_twice(conn: redis.Redis, pid: int) -> None:
    """Two SIGTERMs that the worker cannot take for one delivered twice: the second is sent once
    the worker has recorded the first and the clock is past RQ's one-second repeat window from
    that moment, whatever the delay in handling the first."""
    conn.delete(FIRST_SIGNAL_KEY)
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: conn.get(FIRST_SIGNAL_KEY) is not None, 20, "the worker to take the first SIGTERM")
    first = float(conn.get(FIRST_SIGNAL_KEY))  # type: ignore[arg-type]
    wait_until(lambda: time.time() - first > 1.05, 5, "RQ's repeat window to pass")
    os.kill(pid, signal.SIGTERM)


def _started(conn: redis.Redis, batch: Batch) -> Callable[[], bool]:
    return lambda: batch.job_states()[batch.job_ids[0]] == "started"


def test_sigkill_mid_batch_reruns_elsewhere(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    """The abandoned job is found (heartbeat TTL 2 s, maintenance every 1 s) and re-run by the
    other worker; how fast is measured in benchmarks/chaos.py, not asserted here."""
    batch = _submit(redis_client, tmp_path)
    victim = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 20, "the job to start")
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    spawn(job_s=0.05)
    assert batch.wait(timeout=60).counts["finished"] == 1
    assert _job(redis_client, batch).retries_left == 1  # the abandoned run spent one retry
    assert batch.read().num_rows == 3


def test_abandoned_job_out_of_retries_is_a_visible_failure(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path, retries=0)
    victim = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 20, "the job to start")
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    spawn()
    with pytest.raises(JobsFailedError, match="AbandonedJobError"):
        batch.wait(timeout=20)
    status = collect(redis_client)["pools"]["default"]
    assert status["failed_jobs"] == batch.job_ids
    assert "AbandonedJobError" in status["failure_reasons"][batch.job_ids[0]]


def test_first_sigterm_finishes_and_commits_then_exits(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path)
    worker = spawn(job_s=2)
    wait_until(_started(redis_client, batch), 20, "the job to start")
    os.kill(worker.pid, signal.SIGTERM)  # type: ignore[arg-type]
    worker.join(timeout=20)
    assert worker.exitcode is not None
    assert batch.status().counts["finished"] == 1
    assert [c.rows for c in commit_log.read_all(redis_client, "faults")] == [3]


def test_second_sigterm_hands_the_job_back(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path)
    worker = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 20, "the job to start")
    _sigterm_twice(redis_client, worker.pid)  # type: ignore[arg-type]
    worker.join(timeout=20)
    assert worker.exitcode is not None
    job = _job(redis_client, batch)
    assert job.get_status() == "queued" and job.retries_left == 2  # handed back, no retry spent
    assert job.meta["handed_back"] == 1 and "SIGTERM" in job.meta["handed_back_reason"]
    assert commit_log.read_all(redis_client, "faults") == []
    spawn()
    assert batch.wait(timeout=20).counts["finished"] == 1


def test_second_sigterm_hands_back_every_job_in_flight(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    """With a concurrent engine several jobs run at once; the operator's abort spends none of their retries."""
    requests = [RolloutRequest(id=f"s{i}", input_ids=[1, 2], sampling_params={"max_new_tokens": 4000})
                for i in range(6)]
    batch = Batch(redis_client, submit_requests(redis_client, requests, run="flight", output=f"file://{tmp_path}",
                                                batch_size=2))
    worker = spawn(slow_sim=True)
    wait_until(lambda: list(batch.job_states().values()) == ["started"] * 3, 20, "all three jobs in flight")
    _sigterm_twice(redis_client, worker.pid)  # type: ignore[arg-type]
    worker.join(timeout=20)
    assert worker.exitcode is not None
    for job_id in batch.job_ids:
        job = Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer)
        assert (job.get_status(), job.retries_left, job.meta.get("handed_back")) == ("queued", 2, 1), job_id
    assert commit_log.read_all(redis_client, "flight") == []


def test_failing_engine_makes_the_worker_unhealthy_until_it_recovers(
    redis_client: redis.Redis, tmp_path: Path, spawn
) -> None:
    flag = tmp_path / "engine-down"
    flag.touch()
    spawn(flag=flag)
    batch = _submit(redis_client, tmp_path / "out")

    def unhealthy() -> bool:
        return [w.state for w in registry.live_workers(redis_client)] == ["unhealthy"]

    wait_until(unhealthy, 20, "the worker to mark itself unhealthy")
    [info] = registry.live_workers(redis_client)
    assert "connection refused" in (info.error or "")
    # The registry says unhealthy as soon as the failure is seen; the hand-back follows it.
    wait_until(lambda: _job(redis_client, batch).get_status() == "queued", 10, "the job handed back")
    job = _job(redis_client, batch)
    assert job.get_status() == "queued" and job.retries_left == 2 and job.meta["handed_back"] == 1
    time.sleep(1.5)  # it stops dequeuing: the job stays queued
    assert _job(redis_client, batch).get_status() == "queued"
    flag.unlink()
    assert batch.wait(timeout=20).counts["finished"] == 1
    wait_until(lambda: [w.state for w in registry.live_workers(redis_client)] == ["idle"], 10, "recovery")


def test_a_flaky_object_store_costs_the_engine_nothing(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two puts fail like S3's 503s: the worker retries the write itself with the rows it has.
    store = FlakyStore.install(failures=2)
    monkeypatch.setenv("PIPELINE_SHARD_WRITE_RETRY_S", "30")
    plan = submit_requests(redis_client, REQUESTS, run="flaky", output="flakystore://bucket/rollouts", retries=2)
    batch = Batch(redis_client, plan)
    engine = FakeEngine()
    RolloutWorker(redis_client, engine, maintenance_interval_s=1).work(burst=True, with_scheduler=False,
                                                                         logging_level="ERROR")
    assert batch.wait(timeout=5).counts["finished"] == 1
    assert len(engine.calls) == 1  # generated once, written at the third attempt
    assert len(store.attempts) == 3
    assert _job(redis_client, batch).retries_left == 2  # no job retry spent
    [commit] = commit_log.read_all(redis_client, "flaky")
    assert commit.rows == 3 and batch.read().num_rows == 3


def test_object_store_failure_fails_the_job_with_the_reason_and_commits_nothing(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = FlakyStore.install(failures=10**6)  # down for good
    monkeypatch.setenv("PIPELINE_SHARD_WRITE_RETRY_S", "0.3")
    client = pipeline.Client(redis_client)
    plan = submit_requests(redis_client, REQUESTS, run="store", output="flakystore://bucket/rollouts", retries=1)
    batch = Batch(redis_client, plan)
    assert _job(redis_client, batch).retry_intervals == [1]  # the job's retry waits out a backoff
    engine = FakeEngine()
    RolloutWorker(redis_client, engine, maintenance_interval_s=1).work(burst=True, with_scheduler=False,
                                                                         logging_level="ERROR")
    with pytest.raises(JobsFailedError, match="503 Slow Down"):
        batch.wait(timeout=5)
    assert len(engine.calls) == 2  # tried (the write retried for 0.3 s), retried once after 1 s, then failed
    assert len(store.attempts) > 2
    assert commit_log.read_all(redis_client, "store") == []
    assert not store().exists("flakystore://bucket/rollouts/store")
    assert client.workers() == []
