"""The control channel's trainer side on a real Redis: state, generations, refusals, timeouts."""

from __future__ import annotations

import threading
import time

import pytest
import redis

import pipeline
from pipeline.core.broker import control_channel, keys, registry
from schemas.control import DesiredState, WeightAck
from schemas.worker_info import WorkerInfo
from tests.helpers.processes import wait_until


def _fake_entry(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="fake", model="m",
                                      started_at=now, heartbeat_at=now), ttl_s=30)


def test_state_changes_bump_the_generation_and_wake_workers(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    assert client.control_state() == DesiredState()
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.pool().control_channel)
    assert client.pause() == DesiredState(generation=1, paused=True)
    assert client.resume().generation == 2
    message = None
    for _ in range(20):
        message = message or pubsub.get_message(timeout=0.1)
    assert message is not None and message["channel"] == keys.pool().control_channel.encode()
    assert control_channel.read_state(redis_client) == DesiredState(generation=2, paused=False)


def test_push_without_workers_returns_and_older_versions_are_refused(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    result = client.push_weights("/ckpt/1", version=1, timeout=1)
    assert result.acks == [] and result.version == 1
    assert client.control_state().weight_path == "/ckpt/1"
    for version in (1, 0):
        with pytest.raises(control_channel.WeightVersionError, match="not newer than the current version 1"):
            client.push_weights("/ckpt/x", version=version, timeout=1)
    assert client.control_state().weight_path == "/ckpt/1"
    forced = client.push_weights("/ckpt/0", version=0, timeout=1, force=True)
    assert forced.version == 0 and client.control_state().weight_version == 0


def test_push_names_failed_and_silent_workers(redis_client: redis.Redis) -> None:
    _fake_entry(redis_client, "silent")
    _fake_entry(redis_client, "broken")
    _fake_entry(redis_client, "fine")
    stale = WeightAck(worker="silent", version=3, ok=True, seconds=0.1)
    redis_client.hset(keys.pool().weight_acks(3), "silent", stale.model_dump_json())  # from an earlier push: cleared

    def answer() -> None:
        # Once the push has cleared the stale ack (it has started), however long that took.
        wait_until(lambda: not redis_client.hexists(keys.pool().weight_acks(3), "silent"), 10, "the push to start")
        for ack in (WeightAck(worker="broken", version=3, ok=False, seconds=0.1, error="no such file"),
                    WeightAck(worker="fine", version=3, ok=True, seconds=0.1)):
            redis_client.hset(keys.pool().weight_acks(3), ack.worker, ack.model_dump_json())

    thread = threading.Thread(target=answer)
    thread.start()
    started = time.monotonic()
    with pytest.raises(control_channel.WeightPushError) as info:
        control_channel.push_weights(redis_client, "/ckpt/3", 3, timeout=1.0)
    thread.join()
    assert time.monotonic() - started >= 1.0  # it waited its timeout for the silent worker
    assert info.value.failed == {"broken": "no such file"}
    assert info.value.timed_out == ["silent"]
    assert "broken: failed: no such file" in str(info.value) and "silent: no acknowledgement" in str(info.value)
    # One worker loaded it: the push stands, and says the others take no job until they load it.
    assert info.value.rolled_back is None and "the push stands" in str(info.value)
    assert client_state(redis_client) == (3, "/ckpt/3")


def client_state(conn: redis.Redis) -> tuple[int, str | None]:
    state = control_channel.read_state(conn)
    return state.weight_version, state.weight_path


def test_a_push_no_worker_takes_changes_nothing_and_its_version_is_free_again(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    client.push_weights("/ckpt/1", version=1, timeout=1, mode="partial")
    _fake_entry(redis_client, "broken")
    _fake_entry(redis_client, "silent")

    def answer(version: int) -> None:
        wait_until(lambda: control_channel.read_state(redis_client).weight_version == version, 10, "the push to start")
        ack = WeightAck(worker="broken", version=version, ok=False, seconds=0.1, error="no config.json")
        redis_client.hset(keys.pool().weight_acks(version), ack.worker, ack.model_dump_json())

    for _ in range(2):  # the same version twice: the first failure did not use it up
        thread = threading.Thread(target=answer, args=(2,))
        thread.start()
        with pytest.raises(control_channel.WeightPushError) as info:
            client.push_weights("/does-not-exist", version=2, timeout=0.5)
        thread.join()
        assert info.value.failed == {"broken": "no config.json"} and info.value.timed_out == ["silent"]
        assert "nothing changed, the pool's weights are still v1 (/ckpt/1); version 2 can be pushed again" \
            in str(info.value)
        state = client.control_state()
        assert (state.weight_version, state.weight_path, state.swap_mode) == (1, "/ckpt/1", "partial")


def test_undoing_a_push_keeps_a_pause_made_meanwhile(redis_client: redis.Redis) -> None:
    _fake_entry(redis_client, "silent")
    paused = threading.Thread(target=lambda: (
        wait_until(lambda: control_channel.read_state(redis_client).weight_version == 1, 10, "the push to start"),
        pipeline.Client(redis_client).pause()))
    paused.start()
    with pytest.raises(control_channel.WeightPushError):
        control_channel.push_weights(redis_client, "/ckpt/1", 1, timeout=0.5)
    paused.join()
    state = control_channel.read_state(redis_client)
    assert state.paused and (state.weight_version, state.weight_path) == (0, None)


def test_push_records_its_swap_mode_and_refuses_unknown_ones(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    assert client.control_state().swap_mode == "drain"
    client.push_weights("/ckpt/1", version=1, timeout=1, mode="partial")
    assert client.control_state().swap_mode == "partial"
    client.push_weights("/ckpt/2", version=2, timeout=1)
    assert client.control_state().swap_mode == "drain"  # each push names its own mode; drain by default
    with pytest.raises(pipeline.PipelineError, match="swap mode must be one of drain, partial, not 'eager'"):
        client.push_weights("/ckpt/3", version=3, timeout=1, mode="eager")  # type: ignore[arg-type]
    assert client.control_state().weight_version == 2


def test_a_push_that_finds_no_worker_where_workers_acked_before_waits_for_their_heartbeat(
    redis_client: redis.Redis
) -> None:
    """After a failover the registry's entries can be gone with the old master while the workers
    live: the push waits for their next heartbeat instead of answering "0 of 0 workers loaded"."""
    client = pipeline.Client(redis_client)
    client.push_weights("/ckpt/1", version=1, timeout=1)
    ack = WeightAck(worker="w", version=1, ok=True, seconds=0.1)
    redis_client.hset(keys.pool().weight_acks(1), "w", ack.model_dump_json())  # w loaded v1; its entry is lost

    def heartbeat_then_ack() -> None:
        wait_until(lambda: control_channel.read_state(redis_client).weight_version == 2, 10, "the push to start")
        _fake_entry(redis_client, "w")
        loaded = WeightAck(worker="w", version=2, ok=True, seconds=0.1)
        redis_client.hset(keys.pool().weight_acks(2), "w", loaded.model_dump_json())

    thread = threading.Thread(target=heartbeat_then_ack)
    thread.start()
    result = client.push_weights("/ckpt/2", version=2, timeout=30)
    thread.join()
    assert [a.worker for a in result.acks] == ["w"]
