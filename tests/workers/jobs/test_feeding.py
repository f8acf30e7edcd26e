"""Feeding a concurrent engine across job boundaries: overlap, one shard per job, RQ bookkeeping,
heartbeats for every job in flight, and draining at a weight swap and a pause.

In-process workers on the real Redis with the sim engine; lengths are made exact by a median far
above `max_new_tokens` (every sequence runs to its `max_new_tokens`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import redis
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import keys
from schemas.request import RolloutRequest
from tests.helpers.processes import burst_worker, drive_worker, wait_until
from workers.engines.fake import FakeEngine
from workers.engines.serial import SerialEngine
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker

STEP_S = 0.002


class Recorded(SimEngine):
    """A sim engine that notes when each batch reached it and finished, and when weights loaded."""

    def __init__(self, **config: float) -> None:
        super().__init__(SimConfig(step_s=STEP_S, median_tokens=10_000, p99_tokens=10_001, **config))  # type: ignore[arg-type]
        self.events: list[tuple[float, str, str]] = []  # (time, what, first request id)

    def submit(self, requests: Sequence[RolloutRequest]) -> Future:
        first = requests[0].id
        self.events.append((time.monotonic(), "submit", first))
        future = self._answer(first, super().submit(requests))
        future.add_done_callback(lambda _: self.events.append((time.monotonic(), "done", first)))
        return future

    def _answer(self, first: str, future: Future) -> Future:
        """The future the worker gets for the batch starting with request `first`."""
        return future

    def update_weights(self, path: str, version: int) -> None:
        self.events.append((time.monotonic(), "load", str(version)))
        super().update_weights(path, version)

    def at(self, what: str, first: str) -> float:
        return next(t for t, w, f in self.events if w == what and f == first)


class HeldUntil(Recorded):
    """Holds the answer of the batch starting with `held` until the batch starting with `until`
    has been answered (60 s at most, then the test's order assertions fail): an ordering that
    does not depend on how fast the machine is."""

    def __init__(self, held: str, until: str, **config: float) -> None:
        super().__init__(**config)
        self.held, self.until = held, until
        self.released = threading.Event()

    def _answer(self, first: str, future: Future) -> Future:
        if first == self.until:
            future.add_done_callback(lambda _: self.released.set())
        if first != self.held:
            return future
        outer: Future = Future()

        def hold() -> None:
            result = future.result()
            self.released.wait(60)
            outer.set_result(result)

        threading.Thread(target=hold, daemon=True).start()
        return outer


def job(prefix: str, tokens: Sequence[int]) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": n}}
            for i, n in enumerate(tokens)]




def test_next_job_reaches_the_engine_before_the_last_sequence_ends(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    long = client.submit(job("a", [3, 3, 3, 150]), run="feed", output=f"file://{tmp_path}", batch_size=4)
    short = client.submit(job("b", [3, 3, 3, 3]), run="feed", output=f"file://{tmp_path}", batch_size=4)
    # Job a stays in flight until job b is answered: a worker that waited for a before taking b
    # would leave b unsubmitted until the hold gives up, and the order below would fail.
    engine = HeldUntil("a0", "b0", capacity=16)
    try:
        worker = burst_worker(redis_client, engine)
    finally:
        engine.close()
    assert engine.at("submit", "b0") < engine.at("done", "a0")
    assert engine.at("done", "b0") < engine.at("done", "a0")  # committed on its own, not behind a0
    assert long.wait(timeout=5).counts["finished"] == 1 and short.wait(timeout=5).counts["finished"] == 1
    shards = sorted(p.name for p in (tmp_path / "feed").glob("*.parquet"))
    assert shards == sorted(f"{j}.parquet" for j in long.job_ids + short.job_ids)
    assert long.read().num_rows == 4 and short.read().num_rows == 4
    finished = FinishedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    assert set(finished.get_job_ids()) == set(long.job_ids + short.job_ids)
    assert StartedJobRegistry(keys.pool().queue_name, connection=redis_client).get_job_ids() == []
    assert worker.feeder is not None and worker.feeder.in_flight == 0 and engine.load() == 0


def test_without_feeding_each_job_waits_for_the_last(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    client.submit(job("a", [3, 60]), run="barrier", output=f"file://{tmp_path}", batch_size=2)
    client.submit(job("b", [3, 3]), run="barrier", output=f"file://{tmp_path}", batch_size=2)
    engine = Recorded(capacity=16)
    try:
        burst_worker(redis_client, engine, feed=False)
    finally:
        engine.close()
    assert engine.at("submit", "b0") > engine.at("done", "a0")


def test_a_generate_only_engine_takes_the_same_road_one_job_at_a_time(
    redis_client: redis.Redis, tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(job("f", [2, 2, 2]), run="fake", output=f"file://{tmp_path}", batch_size=1)
    engine = FakeEngine()
    worker = burst_worker(redis_client, engine)  # type: ignore[arg-type]
    assert isinstance(worker.feeder.engine, SerialEngine) and worker.feeder.engine.engine is engine
    assert worker.feeder.max_jobs_in_flight == 1 and not worker.feeder.can_interrupt
    assert [job_id for _, job_id in worker.feeder.admitted] == batch.job_ids  # every job, through the feeder
    assert engine.calls == [["f0"], ["f1"], ["f2"]]
    assert batch.wait(timeout=5).counts["finished"] == 3 and batch.read().num_rows == 3


def test_a_failing_job_fails_alone(redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")  # no worker can serve it: fail at once
    client = pipeline.Client(redis_client)
    bad = client.submit([{"id": "x", "input_ids": [1], "logprobs": 3}], run="mixed", output=f"file://{tmp_path}")
    good = client.submit(job("g", [5, 5]), run="mixed", output=f"file://{tmp_path}")
    engine = Recorded(capacity=8)
    try:
        burst_worker(redis_client, engine)
    finally:
        engine.close()
    assert good.wait(timeout=5).counts["finished"] == 1
    failed = FailedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    assert failed.get_job_ids() == bad.job_ids
    assert "top-3 logprobs" in bad.failures()[bad.job_ids[0]]
    assert [p.name for p in (tmp_path / "mixed").glob("*.parquet")] == [f"{good.job_ids[0]}.parquet"]


def test_every_job_in_flight_keeps_its_heartbeat(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(job("h", [1200, 1200]), run="hb", output=f"file://{tmp_path}", batch_size=1)
    engine = Recorded(capacity=8)
    worker = RolloutWorker(redis_client, engine, heartbeat_interval_s=0.3)
    started = StartedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    seen: list[set[str]] = []

    def watch() -> None:
        wait_until(lambda: len(engine.events) >= 2)
        time.sleep(worker.get_heartbeat_ttl(None) + 0.3)  # type: ignore[arg-type]
        started.cleanup()  # another worker's maintenance: abandoned jobs would be failed here
        seen.append(set(started.get_job_ids()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
    finally:
        engine.close()
    watcher.join()
    assert seen == [set(batch.job_ids)]
    assert batch.wait(timeout=5).counts["finished"] == 2


def test_a_weight_swap_drains_the_jobs_in_flight_first(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    first = client.submit(job("a", [3, 150]), run="swap", output=f"file://{tmp_path}")
    engine = Recorded(capacity=16)
    batches = []

    def driver() -> None:
        wait_until(lambda: any(w == "submit" for _, w, _ in engine.events))
        client.push_weights("/ckpt/v1", version=1, timeout=10)  # acknowledged after the drain
        batches.append(client.submit(job("b", [3]), run="swap", output=f"file://{tmp_path}"))
        assert batches[0].wait(timeout=10).counts["finished"] == 1

    drive_worker(redis_client, engine, driver)
    assert engine.at("done", "a0") < engine.at("load", "1") < engine.at("submit", "b0")
    assert set(first.read().column("weight_version").to_pylist()) == {0}
    assert batches[0].read().column("weight_version").to_pylist() == [1]


def test_a_pause_lets_the_jobs_in_flight_finish_and_takes_no_more(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    first = client.submit(job("a", [100]), run="pause", output=f"file://{tmp_path}")
    engine = Recorded(capacity=16)

    def driver() -> None:
        wait_until(lambda: any(w == "submit" for _, w, _ in engine.events))
        client.pause()
        held = client.submit(job("b", [3]), run="pause", output=f"file://{tmp_path}")
        assert first.wait(timeout=10).counts["finished"] == 1
        time.sleep(0.5)
        assert [f for _, w, f in engine.events if w == "submit"] == ["a0"]
        assert held.status().counts["finished"] == 0
        client.resume()
        assert held.wait(timeout=10).counts["finished"] == 1

    drive_worker(redis_client, engine, driver)
