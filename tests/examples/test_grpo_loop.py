"""examples/grpo_loop.py for two steps on the tiny model: a real redis-server, the `pipeline worker` and
`pipeline reward-worker` processes the example starts, rewards and advantages read back, weights pushed."""

from __future__ import annotations

import math
from pathlib import Path

import redis

from examples.grpo_loop import grpo, parse
from pipeline.core.broker import control_channel, registry
from pipeline.core.shards import read_rollouts


def test_two_steps_submit_score_train_and_push_and_the_second_step_samples_the_pushed_weights(
        redis_url: str, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    # A previous loop's push to a checkpoint that is gone: the loop starts its pool afresh.
    control_channel.push_weights(redis_client, str(tmp_path / "gone"), 7, pool="grpo-test", timeout=0)
    args = parse(["--steps", "2", "--model", str(tiny_model_dir), "--redis", redis_url, "--pool", "grpo-test",
                  "--run", "loop", "--output", f"file://{tmp_path / 'shards'}", "--store", str(tmp_path / "w"),
                  "--groups", "2", "--n", "3", "--max-new-tokens", "4", "--lr", "1e-3", "--timeout", "300"])
    steps = grpo(args, log=lambda line: None)

    assert [(s.step, s.rows, s.row_versions, s.pushed) for s in steps] == [(0, 6, [0], 1), (1, 6, [1], 2)]
    assert all(0.0 <= s.mean_reward <= 1.0 and math.isfinite(s.loss) for s in steps)
    # Every row was scored by the reward worker (numeric_match against the metadata's answer).
    scored = read_rollouts(f"file://{tmp_path / 'shards'}", "loop-1", rewards=True,
                           columns=["rollout_id"]).to_pylist()
    assert len(scored) == 6 and all(row["reward"] in (0.0, 1.0) for row in scored)
    assert control_channel.read_state(redis_client, "grpo-test").weight_version == 2
    # The workers it started are gone.
    assert registry.live_workers(redis_client, "grpo-test") == []


def test_without_a_store_the_loop_leaves_its_pool_naming_no_weights(
        redis_url: str, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The pushed weights lived in a scratch directory the loop deleted: a worker started in the pool
    afterwards would refuse to join on them, so the pool is reset (issue 45: `--pool grpo` refused)."""
    args = parse(["--steps", "1", "--model", str(tiny_model_dir), "--redis", redis_url, "--pool", "grpo-scratch",
                  "--run", "scratch", "--output", f"file://{tmp_path / 'shards'}", "--groups", "1", "--n", "2",
                  "--max-new-tokens", "2", "--timeout", "300"])
    assert [s.pushed for s in grpo(args, log=lambda line: None)] == [1]
    state = control_channel.read_state(redis_client, "grpo-scratch")
    assert state.weight_version == 0 and state.weight_path is None
