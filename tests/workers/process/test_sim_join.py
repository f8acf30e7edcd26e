"""A sim worker joins only a pool whose weights are the sim's: `pipeline worker --engine sim` processes
on a real Redis, against a pool whose desired weights are a real checkpoint or a sim's path."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import redis

import pipeline
from pipeline.core.broker import registry
from tests.conftest import PIPELINE
from tests.helpers.processes import terminate, wait_until


def _sim_worker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PIPELINE, "worker", "--engine", "sim", "--burst", "--log-level", "WARNING", *args],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_sim_worker_does_not_join_a_pool_whose_weights_are_a_real_checkpoint(
        redis_client: redis.Redis, pipeline_env: dict[str, str], v1_model_dir: Path, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    client.push_weights(str(v1_model_dir), version=4, timeout=5)  # no live worker: recorded for those that join
    batch = client.submit([{"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}], run="real",
                          output=f"file://{tmp_path}")

    refused = _sim_worker(pipeline_env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    error = refused.stderr
    assert "does not join pool 'default'" in error and f"weights v4 from {v1_model_dir}" in error, error
    assert "sim engine" in error and "holds a model checkpoint" in error and "--allow-sim-in-real-pool" in error
    assert "Traceback" not in error
    # Nothing was served with made-up tokens, and the worker left no live registry entry.
    assert batch.status().counts["queued"] == 1
    assert registry.live_workers(redis_client) == []


def test_the_sim_joins_a_pool_of_sim_weights_or_a_real_one_when_told(
        redis_client: redis.Redis, pipeline_env: dict[str, str], v1_model_dir: Path, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    client.push_weights("/ckpt/v4", version=4, timeout=5)  # no checkpoint there: the sim's own weights
    request = {"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    sim_run = client.submit([request], run="sim", output=f"file://{tmp_path}")
    joined = _sim_worker(pipeline_env)
    assert joined.returncode == 0, joined.stderr
    assert sim_run.wait(timeout=30).counts["finished"] == 1
    assert sim_run.read().column("weight_version").to_pylist() == [4]

    client.push_weights(str(v1_model_dir), version=5, timeout=5)
    told = client.submit([request], run="told", output=f"file://{tmp_path}")
    allowed = _sim_worker(pipeline_env, "--allow-sim-in-real-pool")
    assert allowed.returncode == 0, allowed.stderr
    assert told.wait(timeout=30).counts["finished"] == 1
    assert told.read().column("engine").to_pylist() == ["sim"]  # labelled as the sim's, for whoever reads it


def test_a_sim_worker_does_not_join_a_pool_real_engines_serve_without_a_push(
        redis_client: redis.Redis, pipeline_env: dict[str, str], start_worker: Callable[..., subprocess.Popen],
        tiny_model_dir: Path) -> None:
    """Nothing pushed: each worker serves the model it started with, and the pool's rows are an hf
    model's at v0; a sim joining would add made-up rows at the same v0."""
    start_worker()
    wait_until(lambda: len(registry.live_workers(redis_client)) == 1, 60, "the hf worker to register")
    refused = _sim_worker(pipeline_env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "does not join pool 'default'" in refused.stderr and "no pushed weights" in refused.stderr
    assert f"1 hf worker(s) with model {tiny_model_dir}" in refused.stderr, refused.stderr
    assert "--allow-sim-in-real-pool" in refused.stderr
    assert _sim_worker(pipeline_env, "--allow-sim-in-real-pool").returncode == 0


def test_sim_workers_share_a_pool_with_nothing_pushed(redis_client: redis.Redis, pipeline_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    """Benchmarks run many sim workers in one pool: a live sim worker does not keep another out."""
    held = subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", "--log-level", "WARNING"], env=pipeline_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(registry.live_workers(redis_client)) == 1, 60, "the first sim worker to register")
        batch = pipeline.Client(redis_client).submit(
            [{"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}], run="sims",
            output=f"file://{tmp_path}")
        joined = _sim_worker(pipeline_env)
        assert joined.returncode == 0, joined.stderr
        assert batch.wait(timeout=30).counts["finished"] == 1
    finally:
        terminate(held)
