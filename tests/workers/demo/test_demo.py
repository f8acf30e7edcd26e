"""`pipeline demo` as a user runs it: in a pool of its own, repeatable, saying where its model is;
and the commands that undo what it left (`pipeline runs delete`, `pipeline pools delete`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import redis

from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.shards import read_rollouts
from tests.conftest import PIPELINE

COLUMNS = ["rollout_id", "completion_token_ids", "weight_version"]


def _demo(env: dict[str, str], tmp_path: Path, run: str) -> str:
    done = subprocess.run(
        [*PIPELINE, "demo", "--run", run, "--max-new-tokens", "4", "--n", "1", "--batch-size", "8",
         "--requests", str(tmp_path / "rollouts.jsonl")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _rows(conn: redis.Redis, run: str) -> list[dict]:
    return sorted(read_rollouts([], run, conn=conn, columns=COLUMNS).to_pylist(), key=lambda r: r["rollout_id"])


def test_the_demo_runs_in_its_own_pool_and_a_second_demo_starts_on_the_base_weights_again(
        pipeline_env: dict[str, str], redis_client: redis.Redis, tmp_path: Path, demo_model_dir: Path) -> None:
    first = _demo(pipeline_env, tmp_path, "d1")
    second = _demo(pipeline_env, tmp_path, "d2")

    # Where the model is, printed for the user (and `demo` names it on the command line).
    assert f"demo model: {demo_model_dir}" in first
    # Nothing pinned in the default pool: no weights pushed there, no run submitted to it.
    default = control_channel.read_state(redis_client, keys.DEFAULT_POOL)
    assert (default.weight_version, default.weight_path) == (0, None)
    assert not redis_client.smembers(keys.pool(keys.DEFAULT_POOL).runs)
    assert sorted(m.decode() for m in redis_client.smembers(keys.pool("demo").runs)) == \
        ["d1", "d1-step2", "d2", "d2-step2"]
    # Each demo's base step ran on the base weights (v0): the same seeds gave the same tokens.
    base_1, base_2 = _rows(redis_client, "d1"), _rows(redis_client, "d2")
    assert {r["weight_version"] for r in base_1 + base_2} == {0}
    assert [r["completion_token_ids"] for r in base_1] == [r["completion_token_ids"] for r in base_2]
    # Its second step ran at v1 both times (not v2 on top of the first demo's push).
    assert {r["weight_version"] for r in _rows(redis_client, "d1-step2") + _rows(redis_client, "d2-step2")} == {1}
    assert "pipeline redis stop" in second and "pipeline runs delete d2 d2-step2" in second

    # `demo` names the model on the command line: verify the base step against it.
    verified = subprocess.run([*PIPELINE, "verify", "d2", "--model", "0=demo", "--rows", "2", "--json"],
                              env=pipeline_env, capture_output=True, text=True, timeout=600)
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert json.loads(verified.stdout)["tokens"] > 0

    # Undo it: one run, then the pool (its desired weights and the runs left).
    deleted = subprocess.run([*PIPELINE, "runs", "delete", "d1"], env=pipeline_env, capture_output=True, text=True,
                             timeout=120)
    assert deleted.returncode == 0, deleted.stderr
    assert "deleted run d1: 1 job(s), 8 row(s) committed; shards kept at" in deleted.stdout
    assert "d1" not in registry.runs(redis_client)
    assert not redis_client.exists(keys.commit_log("d1"), keys.run_totals("d1"), keys.run_batches("d1"))
    dropped = subprocess.run([*PIPELINE, "pools", "delete", "demo"], env=pipeline_env, capture_output=True,
                             text=True, timeout=120)
    assert dropped.returncode == 0, dropped.stderr
    assert "deleted pool demo: desired weights v1 from" in dropped.stdout and "3 run(s)" in dropped.stdout
    assert registry.pools(redis_client) == [keys.DEFAULT_POOL]
    assert registry.runs(redis_client) == []
    assert control_channel.read_state(redis_client, "demo").weight_version == 0
    assert not list(redis_client.scan_iter(match="pipeline:pool:demo:*"))
