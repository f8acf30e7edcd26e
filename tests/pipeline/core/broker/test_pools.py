"""Pools on one Redis: names and keys, control, queues, status, and single-pool data kept as the
default pool (trainer side, one process on a real redis-server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline.audit.status import collect, format_status
from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.errors import PoolNameError
from schemas.control import DesiredState, WeightAck
from schemas.worker_info import WorkerInfo

REQUEST = {"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


def _every_key(pool: keys.PoolKeys) -> list[str]:
    return [f"rq:queue:{pool.queue_name}", pool.control_state, pool.control_channel, pool.weight_acks(1),
            pool.workers, pool.worker("w1"), pool.runs, pool.unservable]


def test_pool_keys_never_collide_and_the_default_pool_keeps_the_single_pool_names() -> None:
    pools = [keys.pool(name) for name in ("default", "a", "b", "a-b", "a_b", "pool", "worker", "control", "A")]
    every = [key for pool in pools for key in _every_key(pool)]
    assert len(every) == len(set(every))
    default = keys.pool("default")
    assert (default.queue_name, default.control_state, default.control_channel, default.weight_acks(3),
            default.workers, default.worker("w1"), default.runs) == (
        "rollouts", "pipeline:control:state", "pipeline:control:wake", "pipeline:control:acks:3",
        "pipeline:workers", "pipeline:worker:w1", "pipeline:runs")
    assert keys.pool("a").control_state == "pipeline:pool:a:control:state"
    assert keys.pool("a").queue_name == "rollouts.a"


@pytest.mark.parametrize("name", ["a:b", "a.b", "-a", "a b", "x" * 65, "ä"])
def test_a_pool_name_that_could_collide_is_refused(name: str) -> None:
    with pytest.raises(PoolNameError, match="must be 1-64 letters"):
        keys.pool(name)


def test_the_pool_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert keys.pool_name() == "default"
    monkeypatch.setenv("PIPELINE_POOL", "actor")
    assert keys.pool_name() == "actor" and keys.pool_name("ref") == "ref"
    monkeypatch.setenv("PIPELINE_POOL", "bad:name")
    with pytest.raises(PoolNameError, match=r"from \$PIPELINE_POOL"):
        keys.pool_name()


def test_control_of_one_pool_leaves_the_other_untouched(redis_client: redis.Redis) -> None:
    actor = pipeline.Client(redis_client, pool="actor")
    ref = pipeline.Client(redis_client, pool="ref")
    wake = redis_client.pubsub(ignore_subscribe_messages=True)
    wake.subscribe(keys.pool("ref").control_channel)
    wake.get_message(timeout=1)
    actor.pause()
    actor.push_weights("/ckpt/7", version=7, timeout=1)
    assert actor.control_state() == DesiredState(generation=2, paused=True, weight_version=7, weight_path="/ckpt/7")
    assert ref.control_state() == DesiredState() and redis_client.get(keys.pool("ref").control_state) is None
    assert wake.get_message(timeout=0.2) is None  # ref's workers were not even woken
    ref.push_weights("/ckpt/1", version=1, timeout=1)  # ref's versions are its own: 1 < 7 is fine
    assert ref.control_state().weight_version == 1 and actor.control_state().weight_version == 7
    assert control_channel.read_state(redis_client) == DesiredState()  # the default pool: never touched
    # The per-call pool overrides the client's.
    assert actor.resume(pool="ref").paused is False and actor.control_state().paused is True


def test_a_push_waits_only_for_its_own_pools_workers(redis_client: redis.Redis) -> None:
    now = 0.0
    for worker_id, pool in (("wa", "actor"), ("wr", "ref")):
        registry.publish(redis_client, WorkerInfo(worker_id=worker_id, pool=pool, host="h", pid=1, engine="fake",
                                                  model="m", started_at=now, heartbeat_at=now))
    assert [w.worker_id for w in registry.live_workers(redis_client, "actor")] == ["wa"]
    assert registry.live_workers(redis_client) == []
    with pytest.raises(control_channel.WeightPushError) as refused:  # nobody answers: it names actor's worker only
        control_channel.push_weights(redis_client, "/ckpt/1", 1, timeout=0.2, pool="actor")
    assert refused.value.timed_out == ["wa"]
    ack = WeightAck(worker="wa", version=2, ok=True, seconds=0.1)
    redis_client.hset(keys.pool("actor").weight_acks(2), "wa", control_channel.encode_ack(ack, "actor"))
    assert control_channel.read_acks(redis_client, 2, "actor") == {"wa": ack}
    assert control_channel.read_acks(redis_client, 1, "ref") == {}


def test_a_signed_state_copied_to_another_pool_is_refused(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_CONTROL_SECRET", "s3cret")
    control_channel.push_weights(redis_client, "/ckpt/9", 9, timeout=1, pool="actor")
    redis_client.set(keys.pool("ref").control_state, redis_client.get(keys.pool("actor").control_state))
    with pytest.raises(control_channel.ControlAuthError, match="signature does not match"):
        control_channel.read_state(redis_client, "ref")


def test_queues_runs_and_status_are_per_pool(redis_client: redis.Redis, tmp_path: Path) -> None:
    actor = pipeline.Client(redis_client, pool="actor")
    a = actor.submit([REQUEST], run="step-a", output=f"file://{tmp_path}")
    b = actor.submit([REQUEST, {**REQUEST, "id": "b"}], run="step-b", output=f"file://{tmp_path}", pool="ref",
                     batch_size=1)
    assert (a.plan.pool, b.plan.pool) == ("actor", "ref")
    queued = {name: Queue(keys.pool(name).queue_name, connection=redis_client, serializer=JSONSerializer).get_job_ids()
              for name in ("default", "actor", "ref")}
    assert queued == {"default": [], "actor": a.job_ids, "ref": b.job_ids}
    assert redis_client.hget(keys.batch(a.plan.batch_id), "pool") == b"actor"
    actor.pause()
    status = collect(redis_client)
    assert list(status["pools"]) == ["default", "actor", "ref"]
    assert status["pools"]["actor"]["queue"] == {"name": "rollouts.actor", "queued": 1, "retrying": 0, "started": 0,
                                                 "failed": 0}
    assert status["pools"]["ref"]["queue"]["queued"] == 2
    assert list(status["pools"]["actor"]["runs"]) == ["step-a"] and list(status["pools"]["ref"]["runs"]) == ["step-b"]
    assert status["pools"]["actor"]["desired"]["paused"] and not status["pools"]["ref"]["desired"]["paused"]
    only = collect(redis_client, pool="ref")
    assert list(only["pools"]) == ["ref"]
    text = format_status(status)
    assert "pool actor\ndesired: paused" in text and "queue rollouts.ref: 2 queued" in text
    json.dumps(status, default=str)


def test_single_pool_data_is_the_default_pools(redis_client: redis.Redis, tmp_path: Path) -> None:
    """What a release without pools left in Redis, under its key names, is the default pool as it stands."""
    redis_client.set("pipeline:control:state", DesiredState(generation=4, weight_version=3,
                                                            weight_path="/ckpt/3").model_dump_json())
    redis_client.sadd("pipeline:runs", "old-run")
    old = Queue("rollouts", connection=redis_client, serializer=JSONSerializer)
    old.enqueue_call("workers.job.run_rollout_batch", args=({"x": 1},), job_id="old-job")
    client = pipeline.Client(redis_client)
    assert client.pool == "default"
    assert client.control_state() == DesiredState(generation=4, weight_version=3, weight_path="/ckpt/3")
    status = collect(redis_client)["pools"]["default"]
    assert status["queue"]["queued"] == 1 and "old-run" in status["runs"]
    assert client.pause().generation == 5  # continues the old state's generations
    batch = client.submit([REQUEST], run="new-run", output=f"file://{tmp_path}")
    assert old.get_job_ids() == ["old-job", *batch.job_ids]
    assert redis_client.smembers("pipeline:runs") == {b"old-run", b"new-run"}
