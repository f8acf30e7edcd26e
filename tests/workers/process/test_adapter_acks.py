"""Acknowledged adapter pushes on real `pipeline worker` processes (hf engine, peft) and a real Redis:
a push returns once every live worker serving adapters has read and checked the version; a worker
that cannot read it is named, and a version no worker took is undone; a worker that joins later
answers the versions pushed before it; racing pushes are each acknowledged, the newer current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

import pipeline
from pipeline.audit.status import format_weights
from pipeline.audit.status import weights as weights_status
from pipeline.core.broker import registry
from pipeline.core.broker.control_channel import read_adapter_acks, read_state
from pipeline.core.errors import AdapterError, AdapterPushError
from tests.helpers.adapters import build_adapter, push_racing
from tests.helpers.processes import wait_until


@pytest.fixture
def client(redis_client: redis.Redis, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> pipeline.Client:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the workers' default store too
    return pipeline.Client(redis_client)


def _live(conn: redis.Redis, count: int) -> list[str]:
    wait_until(lambda: len(registry.live_workers(conn, "default")) == count, timeout=120, what=f"{count} workers")
    return sorted(w.worker_id for w in registry.live_workers(conn, "default"))


def test_a_push_returns_once_every_worker_read_and_checked_it_and_one_joining_later_answers_too(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        start_worker: Any) -> None:
    start_worker()
    start_worker()
    workers = _live(redis_client, 2)
    assert all(w.capabilities.lora_adapters for w in registry.live_workers(redis_client, "default"))

    first = client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql1", seed=1), base=tiny_model_dir)
    assert sorted(a.worker for a in first.acks) == workers
    for ack in first.acks:  # each read every byte of the version and checked it; nothing paused
        assert (ack.ok, ack.adapter, ack.version, ack.seconds) == (True, "sql", 1, 0.0)
        assert ack.bytes_read > 0
    assert read_state(redis_client).adapters == {"sql": 1}
    shown = weights_status(redis_client)
    [entry] = shown["adapters"]
    assert (entry["acknowledged"], entry["failed"], entry["unanswered"]) == (workers, {}, [])
    assert "sql  v1" in format_weights(shown) and "acknowledged by 2 worker(s)" in format_weights(shown)

    second = client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql2", seed=2), base=tiny_model_dir)
    assert [(a.version, a.ok) for a in second.acks] == [(2, True), (2, True)]

    start_worker()  # joins after both pushes: answers the current version on its first read of the state
    late = next(w for w in _live(redis_client, 3) if w not in workers)
    wait_until(lambda: late in read_adapter_acks(redis_client, "sql"), timeout=60, what="the late worker's ack")
    ack = read_adapter_acks(redis_client, "sql")[late]
    assert (ack.ok, ack.version) == (True, 2)


def test_a_version_no_worker_can_read_is_named_and_undone(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        start_worker: Any) -> None:
    start_worker()
    [worker] = _live(redis_client, 1)
    adapter = build_adapter(tiny_model_dir, tmp_path / "sql", seed=1)
    # A store only the pushing process can read: an in-memory filesystem is the pusher's own.
    with pytest.raises(AdapterPushError) as refused:
        client.push_adapter("sql", adapter, base=tiny_model_dir, store="memory://adapter-acks")
    error = refused.value
    assert error.undone and error.rolled_back_to is None and not error.timed_out
    assert list(error.failed) == [worker]
    assert "cannot be read here" in error.failed[worker]
    assert "no worker took it" in str(error)
    # Undone: nothing names the version, and a request naming the adapter is refused at submit.
    assert client.adapters() == {}
    assert read_state(redis_client).adapters == {}
    with pytest.raises(AdapterError, match="never pushed"):
        client.submit([{"id": "r", "input_ids": [5, 9], "adapter": "sql",
                        "sampling_params": {"max_new_tokens": 2}}], run="undone", output=f"file://{tmp_path}/out")

    # The same adapter pushed where the worker reads it: taken, and the earlier version stays undone.
    pushed = client.push_adapter("sql", adapter, base=tiny_model_dir)
    assert [(a.worker, a.ok, a.version) for a in pushed.acks] == [(worker, True, pushed.version)]
    assert client.adapters()["sql"].version == pushed.version


def test_racing_pushes_are_each_acknowledged_and_the_newer_stays_current(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        start_worker: Any) -> None:
    start_worker()
    [worker] = _live(redis_client, 1)
    dirs = [build_adapter(tiny_model_dir, tmp_path / f"a{i}", seed=i) for i in range(3)]
    results = push_racing(client, "sql", dirs, tiny_model_dir)
    assert sorted(r.version for r in results) == [1, 2, 3]
    for result in results:  # each push returned on an ack of its version or a newer one
        [ack] = result.acks
        assert ack.worker == worker and ack.ok and ack.version >= result.version
    assert client.adapters()["sql"].version == 3
    assert read_state(redis_client).adapters == {"sql": 3}
    wait_until(lambda: read_adapter_acks(redis_client, "sql")[worker].version == 3, timeout=30,
               what="the worker's answer to the newest version")
