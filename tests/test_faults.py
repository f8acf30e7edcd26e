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
from pipeline.core.broker import commit_log, registry
from pipeline.core.errors import JobsFailedError
from pipeline.core.jobs import rq_seam
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from tests.helpers.processes import FlakyStore, wait_until
from workers.engines.base import SampleOutput
from workers.engines.fake import FakeEngine
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.errors import EngineUnavailableError
from workers.process.turn_reader import TurnReader
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
            with open(probes_file(self.flag), "a") as probes:  # each failed probe: a loop that did not dequeue
                probes.write(".")
            raise EngineUnavailableError("GET /health_generate: connection refused")


def probes_file(flag: Path) -> Path:
    return flag.with_name(flag.name + ".probes")


FIRST_SIGNAL_KEY = "test:faults:first-shutdown-signal"
SECOND_SIGNAL_KEY = "test:faults:second-shutdown-signal"
HELD_KEY = "test:faults:shutdown-held"
GO_KEY = "test:faults:shutdown-go"


class SignalNoting(RolloutWorker):
    """Notes in Redis when it took its first shutdown signal (RQ's own time of it) and its second."""

    def request_stop(self, signum: int, frame: Any) -> None:
        try:
            super().request_stop(signum, frame)
        finally:
            first = rq_seam.shutdown_requested_at(self)
            if first is not None:
                self.connection.set(FIRST_SIGNAL_KEY, first.timestamp())

    def request_force_stop(self, signum: int, frame: Any) -> None:
        try:
            super().request_force_stop(signum, frame)
        finally:
            self.connection.set(SECOND_SIGNAL_KEY, 1)


def _hold_shutdown(conn: redis.Redis) -> None:
    """Stop the shutdown sequence before it waits for the jobs in flight (as a loaded machine might)
    until the test says go: a second signal then lands outside that wait."""
    original = TurnReader.stop

    def held(self: TurnReader) -> None:
        conn.set(HELD_KEY, 1)
        while not conn.exists(GO_KEY):
            time.sleep(0.01)
        original(self)

    TurnReader.stop = held  # type: ignore[method-assign]  # in the forked worker only


def _serve(url: str, job_s: float, flag: str | None, slow_sim: bool = False, hold: bool = False) -> None:
    from pipeline.core.broker.connection import connect_redis

    if hold:
        _hold_shutdown(connect_redis(url))
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

    def start(job_s: float = 0.05, flag: Path | None = None, slow_sim: bool = False,
              hold: bool = False) -> mp.process.BaseProcess:
        process = mp.get_context("fork").Process(
            target=_serve, args=(redis_url, job_s, str(flag) if flag else None, slow_sim, hold), daemon=True)
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


def _sigterm_twice(conn: redis.Redis, pid: int, before_second: Callable[[], None] = lambda: None) -> None:
    """Two SIGTERMs that the worker cannot take for one delivered twice: the second is sent once
    the worker has recorded the first (and `before_second` returned) and the clock is past RQ's
    one-second repeat window from that moment, whatever the delay in handling the first; returns
    once the worker has taken the second."""
    conn.delete(FIRST_SIGNAL_KEY, SECOND_SIGNAL_KEY)
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: conn.get(FIRST_SIGNAL_KEY) is not None, 60, "the worker to take the first SIGTERM")
    before_second()
    first = float(conn.get(FIRST_SIGNAL_KEY))  # type: ignore[arg-type]
    wait_until(lambda: time.time() - first > 1.05, 5, "RQ's repeat window to pass")
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: conn.exists(SECOND_SIGNAL_KEY), 60, "the worker to take the second SIGTERM")


def _started(conn: redis.Redis, batch: Batch) -> Callable[[], bool]:
    return lambda: batch.job_states()[batch.job_ids[0]] == "started"


def test_sigkill_mid_batch_reruns_elsewhere(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    """The abandoned job is found (heartbeat TTL 2 s, maintenance every 1 s) and re-run by the
    other worker; how fast is measured in benchmarks/chaos.py, not asserted here."""
    batch = _submit(redis_client, tmp_path)
    victim = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 60, "the job to start")
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    spawn(job_s=0.05)
    assert batch.wait(timeout=60).counts["finished"] == 1
    assert _job(redis_client, batch).retries_left == 1  # the abandoned run spent one retry
    assert batch.read().num_rows == 3


def test_abandoned_job_out_of_retries_is_a_visible_failure(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path, retries=0)
    victim = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 60, "the job to start")
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    spawn()
    with pytest.raises(JobsFailedError, match="AbandonedJobError"):
        batch.wait(timeout=60)
    status = collect(redis_client)["pools"]["default"]
    assert status["failed_jobs"] == batch.job_ids
    assert "AbandonedJobError" in status["failure_reasons"][batch.job_ids[0]]


def test_first_sigterm_finishes_and_commits_then_exits(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path)
    worker = spawn(job_s=2)
    wait_until(_started(redis_client, batch), 60, "the job to start")
    os.kill(worker.pid, signal.SIGTERM)  # type: ignore[arg-type]
    worker.join(timeout=60)
    assert worker.exitcode is not None
    assert batch.status().counts["finished"] == 1
    assert [c.rows for c in commit_log.read_all(redis_client, "faults")] == [3]


def test_second_sigterm_hands_the_job_back(redis_client: redis.Redis, tmp_path: Path, spawn) -> None:
    batch = _submit(redis_client, tmp_path)
    worker = spawn(job_s=30)
    wait_until(_started(redis_client, batch), 60, "the job to start")
    _sigterm_twice(redis_client, worker.pid)  # type: ignore[arg-type]
    worker.join(timeout=60)
    assert worker.exitcode is not None
    job = _job(redis_client, batch)
    assert job.get_status() == "queued" and job.retries_left == 2  # handed back, no retry spent
    assert job.meta["handed_back"] == 1 and "SIGTERM" in job.meta["handed_back_reason"]
    assert commit_log.read_all(redis_client, "faults") == []
    spawn()
    assert batch.wait(timeout=60).counts["finished"] == 1


@pytest.mark.parametrize("where", ["waiting for the jobs", "before that wait"])
def test_second_sigterm_hands_back_every_job_in_flight(redis_client: redis.Redis, tmp_path: Path, spawn,
                                                       where: str) -> None:
    """With a concurrent engine several jobs run at once; the operator's abort spends none of their
    retries, wherever in the worker's shutdown the second signal lands (it used to raise where it
    landed: outside the wait for the jobs in flight it skipped that wait, and no job was handed back)."""
    requests = [RolloutRequest(id=f"s{i}", input_ids=[1, 2], sampling_params={"max_new_tokens": 4000})
                for i in range(6)]
    batch = Batch(redis_client, submit_requests(redis_client, requests, run="flight", output=f"file://{tmp_path}",
                                                batch_size=2))
    held = where == "before that wait"
    worker = spawn(slow_sim=True, hold=held)
    wait_until(lambda: list(batch.job_states().values()) == ["started"] * 3, 60, "all three jobs in flight")
    if held:
        _sigterm_twice(redis_client, worker.pid,  # type: ignore[arg-type]
                       lambda: wait_until(lambda: redis_client.exists(HELD_KEY), 60, "the shutdown to be held"))
        redis_client.set(GO_KEY, 1)
    else:
        _sigterm_twice(redis_client, worker.pid)  # type: ignore[arg-type]
    worker.join(timeout=60)  # the sequences would run for minutes: an exit means they were aborted
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

    wait_until(unhealthy, 60, "the worker to mark itself unhealthy")
    [info] = registry.live_workers(redis_client)
    assert "connection refused" in (info.error or "")
    # The registry says unhealthy as soon as the failure is seen; the hand-back follows it.
    wait_until(lambda: _job(redis_client, batch).get_status() == "queued", 60, "the job handed back")
    job = _job(redis_client, batch)
    assert job.get_status() == "queued" and job.retries_left == 2 and job.meta["handed_back"] == 1
    # It stops dequeuing: the probes are its work loop going round without a dequeue; after two
    # more failed ones the job is still queued.
    probed = len(probes_file(flag).read_text()) if probes_file(flag).exists() else 0
    wait_until(lambda: probes_file(flag).exists() and len(probes_file(flag).read_text()) >= probed + 2, 60,
               "two more failed health probes")
    job = _job(redis_client, batch)
    assert job.get_status() == "queued" and job.meta["handed_back"] == 1
    flag.unlink()
    assert batch.wait(timeout=60).counts["finished"] == 1
    wait_until(lambda: [w.state for w in registry.live_workers(redis_client)] == ["idle"], 60, "recovery")


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
