"""TRL's GRPOTrainer generating through the pipeline: a real redis-server, a real `pipeline worker`
process on the tiny model, TRL 1.16 training that model for two steps with `pipeline_rollout`."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import pipeline
from pipeline.core.shards import read_rollouts
from pipeline.integrations.trl import _groups, episode_rows, pipeline_rollout, token_versions
from tests.helpers.processes import wait_until
from tests.pipeline.read.test_lineages import sub_agent_session, table

trl = pytest.importorskip("trl")


def test_groups_follow_trls_repeated_prompts() -> None:
    assert _groups(["a", "a", "b", "b"], 2) == [("a", 2), ("b", 2)]
    # The same prompt drawn twice in a row: two groups.
    assert _groups(["a"] * 4 + ["b", "b"], 2) == [("a", 2), ("a", 2), ("b", 2)]
    # Each prompt once (what TRL's docstring promises): num_generations samples each.
    assert _groups(["a", "b"], 3) == [("a", 3), ("b", 3)]
    with pytest.raises(ValueError, match="repeated 3 times in a row"):
        _groups(["a", "a", "a", "b"], 2)


def test_token_versions_expand_segments() -> None:
    assert token_versions(4, None, 3) == [4, 4, 4]
    assert token_versions(4, [{"start": 0, "version": 4}, {"start": 2, "version": 5}], 5) == [4, 4, 5, 5, 5]


def test_an_episode_of_several_lineages_gives_trl_its_last_with_its_env_mask() -> None:
    lineages = pipeline.read_trajectories(table(sub_agent_session()), rewards={"s": {"reward": 0.5}}).to_pylist()
    items = [{**item, "task_id": "g0", "sample": 0, "status": "finished", "trace_id": "t"} for item in lineages]
    out = episode_rows(items, [{"id": "g0"}], 2, failed_reward=-1.0, pad=0)  # sample 1 failed: no item
    last = lineages[-1]  # turns 0, 3, 6: the lineage of the episode's last call
    start = last["turn_starts"][0]
    assert out["prompt_ids"][0] == last["input_ids"][:start] and out["completion_ids"][0] == last["input_ids"][start:]
    assert out["env_mask"][0] == last["loss_mask"][start:] and out["logprobs"][0] == last["old_logprobs"][start:]
    assert out["episode_lineages"] == [4, 0] and out["episode_reward"] == [0.5, -1.0]
    assert out["env_mask"][1] == [0] and out["episode_status"] == ["finished", "failed"]


def test_two_grpo_steps_through_the_pipeline(
    tmp_path: Path, redis_url: str, tiny_model_dir: Path, start_worker: Callable[..., subprocess.Popen],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    client = pipeline.connect(redis_url, pool="trl")
    start_worker("--pool", "trl")
    wait_until(lambda: len(client.workers()) == 1, timeout=120, what="the worker to register")

    seen: list[dict[str, Any]] = []

    def shorter_is_better(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        seen.append({key: kwargs[key] for key in ("weight_version", "token_weight_versions", "rollout_id",
                                                  "finish_reason", "completion_ids", "answer")})
        return [-len(ids) / 16.0 for ids in kwargs["completion_ids"]]

    prompts = ["abc", "hello", "xyz", "Hi there"]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [p.upper() for p in prompts]})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=3, bf16=False, temperature=1.0,
    )
    output = f"file://{tmp_path / 'shards'}"
    rollout_func, weight_sync = pipeline_rollout(client, run="trl-test", mode="partial",
                                                 store=f"file://{tmp_path / 'weights'}", timeout=180, output=output)
    trainer = GRPOTrainer(model=model, reward_funcs=[shorter_is_better], args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollout_func, callbacks=[weight_sync])
    trainer.train()

    # Two generations of 2 prompts x 2 samples: the first at version 0, the second at the version
    # the callback pushed after step 1, which the worker served.
    assert len(seen) == 2
    assert [set(call["weight_version"]) for call in seen] == [{0}, {1}]
    assert [p.version for p in weight_sync.pushes] == [1, 2]
    assert all(ack.ok for push in weight_sync.pushes for ack in push.acks)
    assert [w.weight_version for w in client.workers()] == [2]
    for call in seen:
        assert len(call["rollout_id"]) == 4 and len(set(call["rollout_id"])) == 4
        for ids, versions, reason in zip(call["completion_ids"], call["token_weight_versions"],
                                         call["finish_reason"], strict=True):
            assert len(versions) == len(ids) and reason in ("stop", "length")
        # TRL's rows line up with the dataset's: each prompt's two samples next to its answer.
        assert call["answer"][0] == call["answer"][1] and call["answer"][2] == call["answer"][3]
    # The rows are the pipeline's: one shard row per completion, in run `trl-test`.
    rows = read_rollouts(output, "trl-test", conn=client.conn, columns=["rollout_id", "weight_version"]).to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == sorted(i for call in seen for i in call["rollout_id"])
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2
    for entry in logged:
        for metric in ("loss", "reward", "reward_std", "completions/mean_length", "rewards/shorter_is_better/mean"):
            assert metric in entry, (metric, sorted(entry))
    # Pushed from memory through the weight store: the first version whole, the next as a delta.
    assert [p.kind for p in weight_sync.pushes] == ["full", "delta"]


def test_grpo_trains_on_multi_turn_episodes_with_the_env_mask(
    tmp_path: Path, redis_url: str, redis_client: Any, tiny_model_dir: Path,
    start_worker: Callable[..., subprocess.Popen], pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.integrations.trl import episode_reward
    from pipeline.serve.server import ServeConfig, Server
    from tests.conftest import PIPELINE
    from tests.helpers.processes import stop_all

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    client = pipeline.connect(redis_url, pool="trl-agents")
    start_worker("--pool", "trl-agents")
    server = Server(ServeConfig(port=0, redis_url=redis_url, pool="trl-agents", tokenizer=str(tiny_model_dir),
                                output=f"file://{tmp_path / 'shards'}", turn_timeout_s=120)).start()
    agent = subprocess.Popen([*PIPELINE, "agent-worker", "--agent", "tests.helpers.agents:text_turns", "--pool",
                              "trl-agents", "--serve", server.url, "--concurrency", "8"], env=pipeline_env,
                             stdout=(tmp_path / "agent.log").open("w"), stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: len(client.workers()) == 1, timeout=120, what="the worker to register")
        seen: list[dict[str, Any]] = []

        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        config = GRPOConfig(
            output_dir=str(tmp_path / "trl"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
            max_completion_length=64, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=3, bf16=False,
        )
        rollout_func, weight_sync = pipeline_rollout(client, run="trl-episodes",
                                                     agent="tests.helpers.agents:text_turns",
                                                     store=f"file://{tmp_path / 'weights'}", timeout=300)

        def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            out = rollout_func(prompts, trainer)
            seen.append({key: list(value) for key, value in out.items()})  # TRL pops env_mask from `out`
            return out

        dataset = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "Hi there"]})
        trainer = GRPOTrainer(model=model, reward_funcs=[episode_reward], args=config, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=recording, callbacks=[weight_sync])
        trainer.train()
    finally:
        server.stop()
        stop_all([agent])

    assert len(seen) == 2 and len(rollout_func.runs) == 2
    for call in seen:
        assert len(call["completion_ids"]) == 4 and all(t for t in call["trace_id"])
        for ids, mask, reward in zip(call["completion_ids"], call["env_mask"], call["episode_reward"], strict=True):
            assert len(mask) == len(ids) and 0 < sum(mask) < len(ids)  # two turns sampled, the glue between not
            assert 0 < reward <= 1
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logged) == 2
    for entry, call in zip(logged, seen, strict=True):
        # TRL counted the sampled tokens only (env_mask as its tool mask) and trained on the agent's reward.
        assert entry["completions/mean_length"] == pytest.approx(sum(map(sum, call["env_mask"])) / 4)
        assert entry["rewards/episode_reward/mean"] == pytest.approx(sum(call["episode_reward"]) / 4)
    assert [p.version for p in weight_sync.pushes] == [1, 2]
