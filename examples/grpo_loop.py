"""A GRPO loop on the pipeline, synchronous and short: submit, read, rewards, advantages, push.

    .venv/bin/python examples/grpo_loop.py [--steps 3] [--model demo] [--pool grpo] [--redis URL]

Each step submits addition problems (`--n` samples each: a GRPO group) with the built-in
`numeric_match` reward, follows the run until a reward worker has scored every shard, reads it
as padded torch batches with GRPO's group-normalised advantages (`RolloutBatches(...,
rewards=True, advantages=True)`), takes one clipped policy-gradient step per batch and pushes the
new weights; the next step asks for them (`min_weight_version`). A `pipeline worker` on `--model`
(`demo`: the demo model `pipeline demo` converted) and a `pipeline reward-worker` are started in
`--pool`, whose weights the loop resets first (refused while a worker serves it), and stopped at
the end; the pool is reset again then (unless `--store` kept the weights), so that it names no
weights in the deleted scratch directory. The asynchronous loop (one step ahead, partial pushes,
importance weights) and TRL's trainer: examples/learn_grpo.py.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import pipeline
from pipeline.core.demo_model import resolve
from pipeline.core.errors import PipelineError
from pipeline.core.jobs.forget import reset_control
from pipeline.integrations.push import push_model

QUESTION = "What is {a} + {b}? Answer with the number only."


@dataclass
class Step:
    """What one step saw and did: the weights its rows came from, their mean reward, the version it pushed."""

    step: int
    rows: int
    row_versions: list[int]
    mean_reward: float
    loss: float
    pushed: int


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The question as the model's chat template renders it (plain text for a tokenizer without one)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  return_dict=False))
    return list(tokenizer(text)["input_ids"])


def requests(tokenizer: Any, rng: random.Random, *, step: int, groups: int, n: int,
             max_new_tokens: int) -> list[dict[str, Any]]:
    """`groups` problems, each sampled `n` times; the answer rides in the metadata for `numeric_match`."""
    lines = []
    for index in range(groups):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append({"id": f"s{step}-{index}", "input_ids": prompt_ids(tokenizer, QUESTION.format(a=a, b=b)),
                      "sampling_params": {"n": n, "max_new_tokens": max_new_tokens, "temperature": 1.0,
                                          "seed": step * 1000 + index},
                      "logprobs": 0, "metadata": {"answer": str(a + b)}})
    return lines


def train_step(model: Any, optimizer: Any, batch: pipeline.Batch, conn: Any) -> tuple[int, list[int], float, float]:
    """One clipped policy-gradient step per torch batch of the run: rows, their versions, mean reward, loss."""
    import torch
    from torch.utils.data import DataLoader

    from pipeline.read.torch_data import RolloutBatches

    data = RolloutBatches(batch.output, run=batch.run, conn=conn, batch_size=64, rewards=True, advantages=True,
                          extra_columns=["weight_version"])
    rows, versions, rewards, losses = 0, set(), [], []
    for tensors in DataLoader(data, batch_size=None):
        logits = model(tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits[:, :-1]
        new_lp = logits.log_softmax(-1).gather(-1, tensors["input_ids"][:, 1:, None]).squeeze(-1)
        mask, old_lp = tensors["loss_mask"][:, 1:], tensors["old_logprobs"][:, 1:]
        ratio = (new_lp - old_lp).exp()
        adv = tensors["advantages"][:, None]
        loss = -(torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rows += len(tensors["rewards"])
        versions.update(tensors["weight_version"])
        rewards.extend(tensors["rewards"].tolist())
        losses.append(loss.item())
    return rows, sorted(versions), sum(rewards) / max(1, len(rewards)), sum(losses) / max(1, len(losses))


def start_workers(model: str, pool: str, redis_url: str | None) -> list[subprocess.Popen]:
    """A rollout worker on `model` and a reward worker, in `pool`; their output goes to this terminal."""
    command = [sys.executable, "-m", "pipeline.cli.main"]
    where = ["--pool", pool, "--new-pool", *(["--redis", redis_url] if redis_url else [])]  # the loop's own pool
    return [subprocess.Popen([*command, "worker", "--model", model, "--log-level", "WARNING", *where]),
            subprocess.Popen([*command, "reward-worker", "--log-level", "WARNING", *where])]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def grpo(args: argparse.Namespace, log: Any = print) -> list[Step]:
    """The loop; each step's record (the test reads them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve(args.model)
    client = pipeline.connect(args.redis, pool=args.pool)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    reset_control(client.conn, client.pool)  # a pool of the loop's own: its workers start on `model` at v0
    version = 0
    run = args.run or f"grpo-{time.strftime('%Y%m%d-%H%M%S')}"
    workers = start_workers(model_dir, client.pool, args.redis)
    steps: list[Step] = []
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-weights-") as scratch:
            store = args.store or scratch
            for step in range(args.steps):
                batch = client.submit(requests(tokenizer, rng, step=step, groups=args.groups, n=args.n,
                                               max_new_tokens=args.max_new_tokens),
                                      run=f"{run}-{step}", output=args.output, reward="numeric_match",
                                      min_weight_version=version)
                for _ in client.follow(batch.run, batch_id=batch.plan.batch_id, rewards=True,
                                       timeout=args.timeout):
                    pass  # each shard once its rewards are recorded; the loop ends with the batch
                rows, versions, reward, loss = train_step(model, optimizer, batch, client.conn)
                version = push_model(client, model, store=os.path.join(store, client.pool), mode="drain",
                                     timeout=args.timeout).version
                steps.append(Step(step, rows, versions, reward, loss, version))
                log(f"step {step}: {rows} rows from weights {versions}, mean reward {reward:.3f}, "
                    f"loss {loss:.4f}; pushed v{version}")
    finally:
        stop(workers)
        if args.store is None:  # the pool named weights in the deleted scratch directory: forget them
            try:
                reset_control(client.conn, client.pool)
            except PipelineError as exc:  # a worker that had to be killed is still registered
                log(f"pool {client.pool} not reset: {exc}")
    return steps


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="demo", help="a model directory, or `demo` (default)")
    parser.add_argument("--pool", default="grpo", help="the pool the loop's workers serve (default grpo)")
    parser.add_argument("--redis", default=None, help="Redis URL (default: the embedded server)")
    parser.add_argument("--run", default=None, help="step k's run is RUN-k (default: grpo-<time>)")
    parser.add_argument("--output", default=None, help="where shards go (default: $PIPELINE_OUTPUT or the state dir)")
    parser.add_argument("--store", default=None,
                        help="the weight store pushes go through (default: a temporary directory)")
    parser.add_argument("--groups", type=int, default=8, help="problems per step")
    parser.add_argument("--n", type=int, default=4, help="samples per problem (the GRPO group)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a step's rollouts or push may take")
    return parser.parse_args(argv)


if __name__ == "__main__":
    grpo(parse())
