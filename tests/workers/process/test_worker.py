"""The worker process class: heartbeats during long jobs, the job allow-list, the registry."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import import_attribute
from rq.worker import WorkerStatus

import pipeline
from pipeline.core.broker import keys, registry
from workers.engines.fake import FakeEngine
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.jobs import allowed_job, batch_job
from workers.process.worker import RolloutWorker


def test_heartbeat_keeps_a_long_job_alive(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.connect(redis_url)
    batch = client.submit([{"id": "a", "input_ids": [1], "sampling_params": {"max_new_tokens": 3}}],
                          run="long", output=f"file://{tmp_path}")
    [job_id] = batch.job_ids
    engine = FakeEngine(delay_s=4.0)
    worker = RolloutWorker(redis_client, engine, heartbeat_interval_s=0.5)
    ttl = worker.get_heartbeat_ttl(Job(job_id, connection=redis_client))
    assert ttl < 4.0, "the test needs a job longer than one heartbeat TTL"
    started = StartedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    observed: list[tuple[float, list[str], str]] = []

    def watch() -> None:
        deadline = time.monotonic() + 3.8
        while time.monotonic() < deadline:
            started.cleanup()  # what other workers' maintenance does to abandoned jobs
            entries = registry.live_workers(redis_client)
            observed.append((time.monotonic(), started.get_job_ids(), entries[0].state if entries else "-"))
            time.sleep(0.25)

    watcher = threading.Thread(target=watch)
    watcher.start()
    worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
    watcher.join()
    late = [ids for t, ids, _ in observed if t - observed[0][0] > ttl + 0.5]
    assert late and all(job_id in ids for ids in late), "the running job lost its heartbeat"
    assert "busy" in {state for _, _, state in observed}
    assert batch.wait(timeout=5).counts["finished"] == 1
    assert batch.read().num_rows == 1
    # The registry entry is removed when the worker exits.
    assert registry.live_workers(redis_client) == []


def test_only_project_job_functions_run(redis_client: redis.Redis, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    queue = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    job = queue.enqueue("os.system", f"touch {marker}")
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="WARNING")
    assert not marker.exists()
    failed = FailedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    assert job.id in failed.get_job_ids()
    fetched = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
    assert "not a rollout pipeline job function" in fetched.latest_result().exc_string


def test_submit_and_worker_name_the_same_job_function() -> None:
    from pipeline.core.jobs.queue import JOB_FUNCTION  # pipeline cannot import workers: the name is written twice

    assert JOB_FUNCTION == allowed_job.JOB_FUNCTION
    assert import_attribute(JOB_FUNCTION) is batch_job.run_rollout_batch


def test_worker_refuses_top_k_it_was_not_started_with(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")  # no worker can serve it: fail at once
    # Submitted while no worker was live (so submit could not check), then served by one without top-k.
    client = pipeline.Client(redis_client)
    batch = client.submit([{"id": "a", "input_ids": [1], "logprobs": 3}], run="topk", output=f"file://{tmp_path}")
    RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0)).work(burst=True, with_scheduler=False,
                                                                     logging_level="WARNING")
    failures = batch.failures()
    assert "top-3 logprobs" in failures[batch.job_ids[0]]
    assert not (tmp_path / "topk").exists()


def test_a_warm_shutdown_while_jobs_run_in_the_feeder_exits_once_they_commit(
    redis_client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM while the loop waits for its next job and a job runs on in the feeder: the wait ends at
    once (RQ alone would call the worker busy and wait out its dequeue timeout, minutes), the job
    in flight finishes and commits, the worker exits."""
    import os
    import signal

    client = pipeline.Client(redis_client)
    engine = SimEngine(SimConfig(step_s=0.02, median_tokens=40, p99_tokens=40))
    batch = client.submit([{"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 40}}],
                          run="warm", output=f"file://{tmp_path}")
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.1)
    hung = threading.Event()

    def driver() -> None:
        while not worker.feeder.in_flight:  # the job has reached the engine; the loop dequeues again
            time.sleep(0.01)
        # RQ's state says busy (as when a job is being finished on the feeder's thread right then).
        worker.set_state(WorkerStatus.BUSY)
        os.kill(os.getpid(), signal.SIGTERM)
        if not done.wait(60):  # still in RQ's dequeue: force it out, and fail
            hung.set()
            os.kill(os.getpid(), signal.SIGTERM)

    done = threading.Event()
    thread = threading.Thread(target=driver)
    thread.start()
    try:
        worker.work(burst=False, with_scheduler=False, logging_level="WARNING")
    finally:
        done.set()
        thread.join(timeout=70)
        engine.close()
    assert not hung.is_set()
    assert batch.status().counts["finished"] == 1 and batch.read().num_rows == 1
    # The operator is told what the wait is and how to cut it short.
    assert "finishing 1 job(s) in flight, then exiting; a second SIGTERM (Ctrl-C) hands them back" in caplog.text


def test_unsubscribing_at_shutdown_does_not_wait_out_rq_pubsub_threads_minute(redis_client: redis.Redis) -> None:
    """RQ's pub/sub thread, once it has read its unsubscribe's reply, waits up to 60 s for a new
    subscription, and RQ's shutdown joined it without a timeout: an idle worker SIGTERMed at that
    moment hung for up to a minute (seen in CI). The worker's shutdown gives it a second."""
    from tests.helpers.processes import wait_until

    worker = RolloutWorker(redis_client, FakeEngine())
    worker.subscribe()
    wait_until(lambda: worker.pubsub.subscribed, 10, "the subscription")
    worker.pubsub.unsubscribe()
    wait_until(lambda: not worker.pubsub.subscribed, 10, "the thread to read the unsubscribe's reply")
    done = threading.Event()
    threading.Thread(target=lambda: (worker.unsubscribe(), done.set()), daemon=True).start()
    assert done.wait(30), "the shutdown waited on RQ's pub/sub thread's 60 s wait"


def test_work_queued_while_the_worker_finishes_its_jobs_in_flight_is_taken_at_once(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    """With nothing queued (burst end, an idle limit) a worker finishes its jobs in flight before it
    looks again; a job queued meanwhile must not wait for the last one's tail (in `rl_loop.py` the
    engine sat idle half the time, the next step's jobs queued behind one long sample)."""
    from pipeline.core.broker import commit_log
    from tests.helpers.processes import run_burst, wait_until

    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    engine = SimEngine(SimConfig(step_s=0.01))
    long = client.submit([{"id": "long", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 400,
                                                                                  "ignore_eos": True}}],
                         run="tail", output=output)
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.1)
    draining = threading.Event()
    drain = worker.feeder.drain

    def watched(timeout: float | None = None) -> bool:
        draining.set()
        return drain(timeout)

    worker.feeder.drain = watched  # type: ignore[method-assign]

    def submit_when_draining() -> None:
        wait_until(draining.is_set, 60, "the worker finishing its job in flight with nothing queued")
        client.submit([{"id": "short", "input_ids": [3], "sampling_params": {"max_new_tokens": 2}}],
                      run="tail", output=output)

    thread = threading.Thread(target=submit_when_draining)
    thread.start()
    run_burst(worker, close=True)
    thread.join(timeout=60)
    order = [c.job_id for c in commit_log.read_all(redis_client, "tail")]
    assert len(order) == 2 and order[1] == long.job_ids[0], order  # the short job committed first
