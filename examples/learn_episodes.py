"""A loop that learns on agent episodes: the demo model taught to use a calculator, through the episode runner.

    .venv/bin/python examples/learn_episodes.py [--steps 20] [--seeds 0 1 2] [--plot PATH]
    make learn-episodes   # 3 seeds, the curve in .state/learn_episodes.png

The task (`examples/calculator_agent.py`): "What is 47 * 38?" with a calculator the model calls by
replying `CALC: 47*38`; the agent sends `RESULT: 1786` back and the next reply is the answer.
SmolLM2-135M-Instruct cannot multiply two-digit numbers, so the reward (1 for the right answer)
comes only through the tool; the untrained model calls it with the right operands about half the
time.

Everything a user would run is real: the embedded Redis, a `pipeline worker` on the demo model,
`pipeline serve` with the demo model's chat template, a `pipeline agent-worker` running the agent,
and the trainer here. The training tasks of all steps go in as one run
(`submit_episodes(..., n=4, max_staleness=1, groups_per_step=4)`): the runner starts a step's
episodes once the weights are at most one version older than the ones they will be trained against
(staleness by admission: none discarded), so the episodes of step s + 1 run while step s trains.
The trainer reads each step's groups (`run.groups(follow=True)`), collates the trajectories
(`collate_trajectories`: the loss mask is 1 exactly on the tokens the model sampled, never on the
tool's result or the template), takes a GRPO step weighted by the truncated importance ratio
against the logprobs the episodes were sampled with (`examples/learn_grpo.py`'s
`policy_gradient_step`), and pushes the weights (`mode="partial"`).

It prints per step the mean reward, the share of episodes that called the tool, the tokens'
version lag and the step's time; per seed the held-out reward (32 problems never trained on,
2 samples each) before and after; `--plot PATH` draws the curves.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import pipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the agent is `examples.calculator_agent:solve`, as the workers import it

from examples.learn_grpo import policy_gradient_step  # noqa: E402
from pipeline.integrations.push import push_model  # noqa: E402

AGENT = "examples.calculator_agent:solve"


@dataclass
class Settings:
    """One training run's knobs (defaults: the demo model on a CPU)."""

    steps: int = 20
    groups: int = 4  # tasks per step
    samples: int = 4  # episodes per task (the GRPO group)
    lr: float = 2e-5  # as learn_grpo's asynchronous loop
    cap: float = 2.0  # the TIS cap on importance ratios
    max_grad_norm: float = 1.0
    max_staleness: int = 1
    heldout: int = 32
    heldout_samples: int = 2
    seed: int = 0


@dataclass
class StepLog:
    step: int
    reward: float
    tool_calls: float  # share of the step's episodes that called the calculator
    max_lag: int  # the largest (trainer's version − token's version) among the step's sampled tokens
    older_share: float
    seconds: float


@dataclass
class Result:
    seed: int
    before: float
    after: float
    tool_before: float
    tool_after: float
    steps: list[StepLog] = field(default_factory=list)


def multiplications(rng: random.Random, count: int,
                    exclude: frozenset[tuple[int, int]] = frozenset()) -> list[tuple[int, int]]:
    """`count` two-digit multiplications (a, b), none in `exclude`."""
    pairs: list[tuple[int, int]] = []
    while len(pairs) < count:
        pair = (rng.randint(11, 99), rng.randint(11, 99))
        if pair not in exclude:
            pairs.append(pair)
    return pairs


def heldout_set(count: int) -> list[tuple[int, int]]:
    """The fixed held-out problems (the same for every seed)."""
    return multiplications(random.Random(1234), count)


def called_tool(table: pa.Table) -> np.ndarray:
    """Per episode, whether the agent recorded a calculator call (its `info`, JSON)."""
    import json

    return np.array([bool(json.loads(info).get("called_tool")) if info else False
                     for info in table.column("info").to_pylist()])


def evaluate(client: pipeline.Client, settings: Settings, *, run: str) -> tuple[float, float]:
    """Mean reward and tool-call share on the held-out problems, at the pool's current weights."""
    tasks = [{"id": f"h{i}", "a": a, "b": b} for i, (a, b) in enumerate(heldout_set(settings.heldout))]
    episodes = client.submit_episodes(tasks, agent=AGENT, run=run, n=settings.heldout_samples, failed_reward=0.0,
                                      max_staleness=0, groups_per_step=len(tasks))
    episodes.wait(timeout=3600)
    table = episodes.trajectories()
    return float(np.mean(table.column("reward").to_pylist())), float(called_tool(table).mean())


def train_on(model: Any, optimizer: Any, groups: list[pa.Table], *, version: int, settings: Settings,
             pad_id: int) -> tuple[float, float, int]:
    """One GRPO step on a step's groups of episodes: (mean reward, older-version token share, max lag)."""
    import torch

    from pipeline.read.torch_data import grpo_advantages
    from pipeline.read.trajectory_batches import collate_trajectories

    rows = [row for group in groups for row in group.to_pylist()]
    rewards = np.array([row["reward"] for row in rows], dtype=np.float64)
    group_index = np.repeat(np.arange(len(groups)), [group.num_rows for group in groups])
    batch = collate_trajectories(rows, pad_id=pad_id)
    advantages = torch.from_numpy(grpo_advantages(rewards, group_index))
    older, _, _, _ = policy_gradient_step(model, optimizer, batch, advantages, version=version, cap=settings.cap,
                                          max_grad_norm=settings.max_grad_norm)
    versions = batch["token_weight_version"][batch["loss_mask"].bool()]
    lag = int(version - versions.min()) if versions.numel() else 0
    return float(rewards.mean()), older, lag


def episode_loop(client: pipeline.Client, model_dir: str, settings: Settings, *, name: str, store: str,
                 log: Any = print) -> Result:
    """Train the demo model on calculator episodes; the held-out reward before and after."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    version = client.control_state().weight_version
    before, tool_before = evaluate(client, settings, run=f"{name}-heldout-before")
    log(f"[seed {settings.seed}] held-out reward before: {before:.3f} (tool calls {tool_before:.0%})")

    rng = random.Random(settings.seed)
    pairs = multiplications(rng, settings.steps * settings.groups, exclude=frozenset(heldout_set(settings.heldout)))
    tasks = [{"id": f"s{i // settings.groups:03d}-{i % settings.groups}", "a": a, "b": b}
             for i, (a, b) in enumerate(pairs)]
    run = client.submit_episodes(tasks, agent=AGENT, run=f"{name}-train", n=settings.samples, failed_reward=0.0,
                                 max_staleness=settings.max_staleness, groups_per_step=settings.groups)
    finished: dict[int, list[pa.Table]] = {}
    steps = iter(range(settings.steps))
    step = next(steps)
    started = time.perf_counter()
    result = Result(settings.seed, before, 0.0, tool_before, 0.0)
    for group in run.groups(follow=True, timeout=3600):
        finished.setdefault(int(group.column("task_id")[0].as_py()[1:4]), []).append(group)
        while len(finished.get(step, [])) == settings.groups:
            groups = finished.pop(step)
            tools = float(np.mean([called_tool(g).mean() for g in groups]))
            reward, older, lag = train_on(model, optimizer, groups, version=version, settings=settings, pad_id=pad_id)
            version = push_model(client, model, store=store, mode="partial").version
            entry = StepLog(step, reward, tools, lag, older, time.perf_counter() - started)
            result.steps.append(entry)
            log(f"[seed {settings.seed}] step {step}: reward {reward:.3f} tool calls {tools:.0%} "
                f"older-version tokens {older:.0%} (max lag {lag}) {entry.seconds:.1f} s")
            started = time.perf_counter()
            step = next(steps, -1)
    result.after, result.tool_after = evaluate(client, settings, run=f"{name}-heldout-after")
    log(f"[seed {settings.seed}] held-out reward after {settings.steps} steps: {result.after:.3f} "
        f"(tool calls {result.tool_after:.0%})")
    return result


def plot(results: list[Result], path: str) -> None:
    """Mean training reward and tool-call share per step, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rewards, tools) = plt.subplots(1, 2, figsize=(10, 4))
    for result in results:
        label = f"seed {result.seed} (held-out {result.before:.2f} → {result.after:.2f})"
        rewards.plot([s.step + 1 for s in result.steps], [s.reward for s in result.steps], alpha=0.8, label=label)
        tools.plot([s.step + 1 for s in result.steps], [s.tool_calls for s in result.steps], alpha=0.8)
    rewards.set(xlabel="step", ylabel="mean episode reward", title="calculator episodes: reward")
    tools.set(xlabel="step", ylabel="share of episodes calling the tool", title="tool calls")
    rewards.legend(fontsize=7)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def start_processes(redis_url: str, pool: str, model: str, log_dir: Path) -> tuple[list[subprocess.Popen], str]:
    """A GPU-side worker, `pipeline serve` and an agent worker for `pool`; the server's URL."""
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "pipeline.cli.main"]
    common = ["--redis", redis_url, "--pool", pool, "--new-pool"]  # a pool of its own, named like the last one
    commands = {
        "worker": [*cli, "worker", "--model", model, *common],
        "serve": [*cli, "serve", "--tokenizer", model, "--port", str(port), *common],
        "agent-worker": [*cli, "agent-worker", "--agent", AGENT, "--serve", url, "--concurrency", "32", *common],
    }
    processes = [subprocess.Popen(command, cwd=ROOT, stdout=(log_dir / f"{what}.log").open("w"),
                                  stderr=subprocess.STDOUT) for what, command in commands.items()]
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code < 500:
                return processes, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or processes[1].poll() is not None:
            raise RuntimeError(f"pipeline serve did not come up; see {log_dir / 'serve.log'}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--redis", default=None, help="a Redis URL (default: $PIPELINE_REDIS_URL, else the "
                                                      "embedded server)")
    parser.add_argument("--plot", default=None, help="write the learning curves here (PNG)")
    args = parser.parse_args(argv)
    from pipeline.core.broker.connection import connect_redis, resolve_url
    from pipeline.core.jobs.forget import reset_control
    from workers.engines.hf.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    url = resolve_url(args.redis)
    conn = connect_redis(url)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="learn-episodes-") as tmp:
        for seed in args.seeds:
            name = f"learn-episodes-{seed}-{int(time.time())}"
            logs = Path(tmp) / name
            logs.mkdir()
            processes, _ = start_processes(url, name, model, logs)
            try:
                results.append(episode_loop(pipeline.Client(conn, name), model, Settings(steps=args.steps, seed=seed),
                                            name=name, store=f"{tmp}/{name}-weights"))
            finally:
                for process in processes:
                    process.terminate()
                for process in processes:
                    process.wait(timeout=120)
                # The pool names weights in this temporary directory: forget them, so nothing is left pinned.
                reset_control(conn, name)
    for result in results:
        print(f"seed {result.seed}: held-out reward {result.before:.3f} -> {result.after:.3f}, tool calls "
              f"{result.tool_before:.0%} -> {result.tool_after:.0%}, in {len(result.steps)} steps "
              f"(median step {statistics.median(s.seconds for s in result.steps):.1f} s, "
              f"max lag {max(s.max_lag for s in result.steps)})")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
