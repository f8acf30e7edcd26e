"""examples/learn_episodes.py for two steps on the tiny model: a real redis-server, a real `pipeline
worker`, `pipeline serve` and `pipeline agent-worker` running the calculator agent; the trainer
follows the run's groups, trains on each step's episodes and pushes partially; the staleness bound
holds on every trained token, and the held-out episodes after training ran on the last weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import pipeline
from examples.calculator_agent import calculate, last_number
from examples.learn_episodes import Settings, episode_loop, start_processes
from tests.helpers.processes import stop_all, wait_until

SETTINGS = Settings(steps=2, groups=2, samples=2, lr=1e-3, heldout=2, heldout_samples=2)


@pytest.fixture
def chat_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a chat template (the agent talks in chat messages)."""
    from transformers import AutoTokenizer

    path = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}>{% endif %}")
    tokenizer.save_pretrained(path)
    return path


def test_two_steps_on_episodes(tmp_path: Path, redis_url: str, chat_model_dir: Path) -> None:
    client = pipeline.connect(redis_url, pool="learn-episodes")
    logs = tmp_path / "logs"
    logs.mkdir()
    processes, _ = start_processes(redis_url, "learn-episodes", str(chat_model_dir), logs)
    try:
        wait_until(lambda: len(client.workers()) == 1, timeout=120, what="the worker to register")
        result = episode_loop(client, str(chat_model_dir), SETTINGS, name="le", store=str(tmp_path / "w"),
                              log=lambda line: None)
    finally:
        stuck = stop_all(processes, timeout=60)
    assert not stuck

    assert [s.step for s in result.steps] == [0, 1]
    # Step 0 trains v0 on episodes v0 sampled; step 1's episodes started at most one version behind.
    assert result.steps[0].max_lag == 0 and result.steps[0].older_share == 0
    assert all(0 <= s.max_lag <= SETTINGS.max_staleness for s in result.steps)
    train = pipeline.read_trajectories("le-train", conn=client.conn, groups=True)
    assert len(train) == SETTINGS.steps * SETTINGS.groups
    assert all(g.num_rows == SETTINGS.samples for g in train)
    # Both pushes were served: the held-out episodes after training sampled every token at v2.
    after = pipeline.read_trajectories("le-heldout-after", conn=client.conn)
    sampled = {v for row in after.to_pylist() for v, m in zip(row["token_weight_version"], row["loss_mask"],
                                                             strict=True) if m}
    assert sampled == {2}
    assert 0.0 <= result.before <= 1.0 and 0.0 <= result.after <= 1.0


def test_the_calculator_evaluates_arithmetic_only() -> None:
    assert calculate("47*38") == 1786 and calculate(" (12 + 3) * 2 ") == 30 and calculate("7/2") == 3.5
    assert calculate("__import__('os')") is None and calculate("1/0") is None and calculate("2**99999") is None
    assert last_number("the answer is 1,786.") == 1786 and last_number("none") is None
