"""examples/learn_grpo.py for two steps on the tiny model: a real redis-server, a real `pipeline worker`
process, both loops (the asynchronous pipeline loop with partial pushes and TIS, and TRL's GRPOTrainer);
the pipeline loop's rewards recorded by a real `pipeline reward-worker` and shown by `pipeline report`."""

from __future__ import annotations

import shlex
import shutil
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeline
from examples.learn_grpo import (
    Settings,
    await_rewards,
    main,
    pipeline_loop,
    start_reward_worker,
    trl_loop,
    write_report,
)
from pipeline.audit.report_rewards import TITLE
from pipeline.core.shards import read_rollouts
from tests.conftest import PIPELINE
from tests.helpers.processes import stop_all, wait_until
from tests.pipeline.audit.test_report import Page

SETTINGS = Settings(steps=2, groups=2, samples=2, max_new_tokens=4, lr=1e-3, async_lr=1e-3, heldout=2,
                    heldout_samples=2)


@pytest.fixture
def chat_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a chat template (the example's prompts are chat messages)."""
    from transformers import AutoTokenizer

    path = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(path)
    return path


def _client(redis_url: str, pool: str, start_worker: Callable[..., subprocess.Popen]) -> pipeline.Client:
    client = pipeline.connect(redis_url, pool=pool)
    start_worker("--pool", pool)
    wait_until(lambda: len(client.workers()) == 1, timeout=120, what="the worker to register")
    return client


def test_two_steps_of_the_pipeline_loop(tmp_path: Path, redis_url: str, chat_model_dir: Path,
                                        start_worker: Callable[..., subprocess.Popen]) -> None:
    client = _client(redis_url, "learn", start_worker)
    scorer = start_reward_worker(redis_url)
    output = f"file://{tmp_path / 'shards'}"
    try:
        result = pipeline_loop(client, chat_model_dir, SETTINGS, run="learn", output=output,
                               store=str(tmp_path / "w"), log=lambda line: None)
        await_rewards(client, result, "learn", timeout=120)
    finally:
        stop_all([scorer])

    assert [s.step for s in result.steps] == [0, 1]
    first, second = result.steps
    # Step 0 trains v0 on rows v0 sampled: every ratio is the trainer's and the engine's logprob of
    # the same weights, so 1 up to float error.
    assert first.version == 0 and set(first.reward_by_version) == {0} and first.older_share == 0
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-3) and first.ratio_max < 1.01
    # Step 1 trains v1 on rows submitted before v1 was pushed: their tokens are v0's, or v1's after the
    # partial swap; the v0 ones are the older share.
    assert second.version == 1 and set(second.reward_by_version) <= {0, 1}
    assert 0.0 <= second.older_share <= 1.0
    # Both pushes were served: the worker holds v2 and the held-out rows after training are v2's.
    assert [w.weight_version for w in client.workers()] == [2]
    rows = read_rollouts(output, "learn", conn=client.conn, columns=["request_id", "weight_version"]).to_pylist()
    assert {r["weight_version"] for r in rows if r["request_id"].startswith("heldout-v2")} == {2}
    assert {r["weight_version"] for r in rows if r["request_id"].startswith("heldout-v0")} == {0}
    assert 0.0 <= result.before <= 1.0 and 0.0 <= result.after <= 1.0

    # The run's report: the reward worker's rewards per step are the ones the loop trained on and printed,
    # per version those of the version that finished each row; the held-out rows (no reward function)
    # are left out and counted.
    write_report(client, "learn", str(tmp_path / "learn.html"))
    text = (tmp_path / "learn.html").read_text()
    page = Page(text)
    assert page.titles[0] == TITLE
    steps = page.table_with("step")
    assert [s["batch"] for s in steps] == result.scored and len(result.scored) == 2
    assert [int(s["rows"]) for s in steps] == [SETTINGS.groups * SETTINGS.samples] * 2
    assert [float(s["mean reward"]) for s in steps] == pytest.approx([s.reward for s in result.steps], abs=1e-3)
    scored = read_rollouts(output, "learn", conn=client.conn, rewards=True,
                           columns=["weight_version", "weight_version_segments", "request_id"]).to_pylist()
    by_version: dict[int, list[float]] = defaultdict(list)
    for row in scored:
        if not row["request_id"].startswith("heldout"):
            segments = row["weight_version_segments"]
            by_version[segments[-1]["version"] if segments else row["weight_version"]].append(row["reward"])
    shown = {v["version"]: v for v in page.table_with("continued rows")}
    assert sorted(shown) == [f"v{v}" for v in sorted(by_version)]
    for version, rewards in by_version.items():
        assert int(shown[f"v{version}"]["rows"]) == len(rewards)
        assert float(shown[f"v{version}"]["mean reward"]) == pytest.approx(statistics.fmean(rewards), abs=1e-3)
    held_out = 2 * SETTINGS.heldout * SETTINGS.heldout_samples  # before and after training
    assert f"{held_out} row(s) have no reward" in text


def test_two_steps_of_the_trl_loop(tmp_path: Path, redis_url: str, chat_model_dir: Path,
                                   start_worker: Callable[..., subprocess.Popen]) -> None:
    pytest.importorskip("trl")
    client = _client(redis_url, "learn-trl", start_worker)
    output = f"file://{tmp_path / 'shards'}"
    result = trl_loop(client, chat_model_dir, SETTINGS, run="learn-trl", output=output, store=str(tmp_path / "w"),
                      log=lambda line: None)

    assert [s.step for s in result.steps] == [0, 1]
    assert [w.weight_version for w in client.workers()] == [2]
    rows = read_rollouts(output, "learn-trl", conn=client.conn, columns=["request_id", "weight_version"])
    versions = [r["weight_version"] for r in rows.to_pylist() if not r["request_id"].startswith("heldout")]
    # Two generations of 2 prompts x 2 samples: the first at v0, the second at v1 (pushed after step 1).
    assert sorted(versions) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_example_writes_its_report_and_prints_the_command(tmp_path: Path, redis_url: str, chat_model_dir: Path,
                                                             pipeline_env: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`learn_grpo.py --report PATH` as a user runs it (its own worker and reward worker processes, the
    default shard location): the report has a step per training batch, and the printed `pipeline report`
    command writes the same page."""
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the default shards, under tmp_path
    out = tmp_path / "learn.html"
    assert main(["--loop", "pipeline", "--steps", "2", "--model", str(chat_model_dir), "--redis", redis_url,
                 "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    steps = Page(out.read_text()).table_with("step")
    assert [s["step"] for s in steps] == ["0", "1"]
    assert [int(s["rows"]) for s in steps] == [Settings.groups * Settings.samples] * 2
    (command,) = [line.removeprefix("report: ") for line in printed.splitlines()
                  if line.startswith("report: pipeline report ")]
    done = subprocess.run([*PIPELINE, *shlex.split(command)[1:]], cwd=tmp_path, env=pipeline_env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (written,) = tmp_path.glob("learn-pipeline-*.html")
    assert Page(written.read_text()).table_with("step") == steps
