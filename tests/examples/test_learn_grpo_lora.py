"""examples/learn_grpo_lora.py for two steps on the tiny model: a real redis-server, a real `pipeline
worker` process; the LoRA adapter pushed before and after each step, every row sampled on the adapter
version current at its job's start, an adapter push a small fraction of a full one's bytes."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeline
from examples.learn_grpo import Settings
from examples.learn_grpo_lora import lora_loop
from pipeline.core.shards import read_rollouts
from tests.helpers.processes import wait_until
from tests.pipeline.integrations.test_learn_grpo import chat_model_dir  # noqa: F401 (a fixture)

SETTINGS = Settings(steps=2, groups=2, samples=2, max_new_tokens=4, heldout=2, heldout_samples=2)


def test_two_steps_train_and_push_the_adapter_each_step(
        tmp_path: Path, redis_url: str, chat_model_dir: Path,  # noqa: F811
        start_worker: Callable[..., subprocess.Popen], pipeline_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the adapter store the worker reads
    client = pipeline.connect(redis_url, pool="lora")
    start_worker("--pool", "lora", "--model", str(chat_model_dir))
    wait_until(lambda: len(client.workers()) == 1, timeout=120, what="the worker to register")
    output = f"file://{tmp_path / 'shards'}"
    result = lora_loop(client, chat_model_dir, SETTINGS, run="lora", output=output, adapter="pol", rank=4,
                       lr=1e-2, log=lambda line: None)
    assert len(result.rewards) == 2 and len(result.push_seconds) == 2
    assert client.adapters()["pol"].version == 3  # v1 before training, one push after each step
    assert 0 < result.push_bytes < result.full_bytes / 4
    rows = read_rollouts([], run="lora", conn=client.conn).to_pylist()
    by_tag = {(r["request_id"].split("-")[0], r["adapter"], r["adapter_version"]) for r in rows}
    # held-out before on v1, step 0 on v1, step 1 on v2 (pushed after step 0), held-out after on v3
    assert by_tag == {("heldout", "pol", 1), ("s0", "pol", 1), ("s1", "pol", 2), ("heldout", "pol", 3)}
