"""Workers in pools: each follows only its pool's control state and serves only its pool's queue
(in-process workers with the fake engine; `pipeline` processes for `--pool` and `$PIPELINE_POOL`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import control_channel, registry
from pipeline.core.jobs.queue import JOB_FUNCTION
from schemas.control import DesiredState
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from tests.helpers.processes import burst_worker, stop_all, wait_until
from workers.engines.fake import FakeEngine

REQUEST = {"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


def test_a_push_and_a_pause_in_one_pool_leave_the_other_serving(redis_client: redis.Redis, tmp_path: Path) -> None:
    actor = pipeline.Client(redis_client, pool="actor")
    ref = pipeline.Client(redis_client, pool="ref")
    actor.push_weights("/ckpt/v1", version=1, timeout=5)
    actor.pause()
    held = actor.submit([REQUEST], run="a", output=f"file://{tmp_path}")
    served = ref.submit([REQUEST], run="r", output=f"file://{tmp_path}")
    actor_engine, ref_engine = FakeEngine(), FakeEngine()
    ref_worker = burst_worker(redis_client, ref_engine, pool="ref", control_poll_s=0.2)
    assert ref_engine.updates == [] and ref_engine.calls == [["a"]]
    assert served.wait(timeout=5).counts["finished"] == 1 and served.read().column("weight_version").to_pylist() == [0]
    assert ref_worker.info.pool == "ref"
    burst_worker(redis_client, actor_engine, pool="actor", control_poll_s=0.2)  # paused: loads v1, takes nothing
    assert actor_engine.updates == [("/ckpt/v1", 1)] and actor_engine.calls == []
    assert held.status().counts["queued"] == 1
    [ack] = control_channel.read_acks(redis_client, 1, "actor").values()
    assert ack.ok and control_channel.read_acks(redis_client, 1, "ref") == {}
    actor.resume()
    burst_worker(redis_client, actor_engine, pool="actor", control_poll_s=0.2)
    assert held.wait(timeout=5).counts["finished"] == 1 and held.read().column("weight_version").to_pylist() == [1]
    assert ref_engine.calls == [["a"]]  # nothing of actor's reached ref's worker


def test_pool_on_the_command_line_and_from_the_environment(pipeline_env: dict[str, str], redis_client: redis.Redis,
                                                           tmp_path: Path) -> None:
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps(REQUEST) + "\n")
    output = f"file://{tmp_path / 'shards'}"
    sim = ["--engine", "sim", "--sim-step-ms", "1", "--sim-median-tokens", "2", "--sim-p99-tokens", "4",
           "--heartbeat-interval", "1"]
    in_b = {**pipeline_env, "PIPELINE_POOL": "b"}
    workers = [subprocess.Popen([*PIPELINE, "worker", *sim, "--pool", "a"], env=pipeline_env),
               subprocess.Popen([*PIPELINE, "worker", *sim], env=in_b)]
    try:
        wait_until(lambda: [len(registry.live_workers(redis_client, p)) for p in "ab"] == [1, 1], 60, "both workers")

        def cli(*args: str, env: dict[str, str] = pipeline_env) -> str:
            return subprocess.run([*PIPELINE, *args], env=env, capture_output=True, text=True, check=True).stdout

        assert "pool a: paused" in cli("pause", "--pool", "a")
        assert "(pool a)" in cli("submit", str(requests), "--run", "in-a", "--output", output, "--pool", "a")
        assert "pool b: weights v1" in cli("weights", "push", "/ckpt/1", "--version", "1", env=in_b)
        cli("submit", str(requests), "--run", "in-b", "--output", output, "--wait", "--timeout", "60", env=in_b)
        status = json.loads(cli("status", "--json"))["pools"]
        assert set(status) == {"default", "a", "b"}
        assert status["a"]["queue"]["queued"] == 1 and status["b"]["queue"]["queued"] == 0
        assert [(w["pool"], w["weight_version"]) for w in status["a"]["workers"]] == [("a", 0)]
        assert [(w["pool"], w["weight_version"]) for w in status["b"]["workers"]] == [("b", 1)]
        assert list(json.loads(cli("status", "--json", env=in_b))["pools"]) == ["b"]
        cli("resume", "--pool", "a")

        def shards_of_a() -> int:
            runs = json.loads(cli("status", "--json", "--pool", "a"))["pools"]["a"]["runs"]
            return runs["in-a"]["shards"]

        wait_until(lambda: shards_of_a() == 1, 60, "pool a's job after resume")
    finally:
        stuck = stop_all(workers)
    assert not stuck, "a worker did not exit within 30 s of SIGTERM (its threads' stacks are in the captured stderr)"
    assert os.path.isdir(tmp_path / "shards" / "in-a") and os.path.isdir(tmp_path / "shards" / "in-b")


def test_state_left_by_a_single_pool_release_is_the_default_pools_and_a_job_without_needs_is_refused(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Upgrade: the previous release's desired state (`pipeline:control:state`) is the default pool's.
    A job in its queue that does not say what it needs of a worker (`needs` in its meta, which
    admission checks, the worker's one check) is failed with the reason, nothing run or written:
    never run unchecked."""
    redis_client.set("pipeline:control:state", DesiredState(generation=4, weight_version=2,
                                                            weight_path="/ckpt/v2").model_dump_json())
    payload = JobPayload.pack([RolloutRequest.model_validate(REQUEST)], run="old", job_id="old-00000",
                              batch_id="old", output=f"file://{tmp_path}", submitted_at_ms=0)
    Queue("rollouts", connection=redis_client, serializer=JSONSerializer).enqueue_call(
        JOB_FUNCTION, args=(payload.model_dump(mode="json"),), job_id="old-00000", meta={"run": "old"})
    engine = FakeEngine()
    worker = burst_worker(redis_client, engine, pool=None, control_poll_s=0.2)
    assert worker.pool.name == "default" and engine.updates == [("/ckpt/v2", 2)] and engine.calls == []
    job = Job.fetch("old-00000", connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() == "failed"
    assert "says nothing of what it needs of a worker" in job.latest_result().exc_string
    assert not (tmp_path / "old").exists()
