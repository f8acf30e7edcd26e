"""GRPO that trains a LoRA adapter through the pipeline: the single-digit addition task of
`examples/learn_grpo.py` on the demo model, the base weights frozen, the adapter pushed each step.

    .venv/bin/python examples/learn_grpo_lora.py [--steps 20] [--rank 16] [--lr 5e-4] [--seed 0]

The trainer wraps the model with peft (LoRA of rank `--rank` on q/k/v/o_proj; B starts at zero, so
version 1 is the base model's policy) and pushes the adapter as version 1 of `--adapter`. Each
step submits its prompts naming the adapter (every row records `adapter` and `adapter_version`),
waits for them (synchronous: a job runs on the adapter version current at its start), takes one
GRPO step on the LoRA parameters (`learn_grpo.train_step`: group-normalised advantages, TIS
against the logprobs the rows were sampled with) and pushes the adapter again
(`pipeline.push_adapter`): megabytes, acknowledged by the worker, applied from the next job, no pause.

Prints the held-out reward (16 problems never trained on, 2 samples each) before and after, each
adapter push's seconds and bytes, and, as the baseline, a full push of the same model written to a
weight store (the bytes and writer-side seconds each step of the full-model loop pays). A worker
process on the demo model and the embedded Redis are started unless `--no-worker`.
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

import pipeline
from pipeline.integrations.push import push_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: `examples` importable

from examples.learn_grpo import (
    COLUMNS,
    Settings,
    heldout_set,
    problems,
    requests,
    rewards_of,
    train_step,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class LoraResult:
    before: float
    after: float
    rewards: list[float] = field(default_factory=list)  # mean training reward per step
    push_seconds: list[float] = field(default_factory=list)  # each adapter push (writer side)
    push_bytes: int = 0  # one adapter version
    full_seconds: float = 0.0  # a full push of the same model (writer side), the baseline
    full_bytes: int = 0


def on_adapter(lines: list[dict], adapter: str) -> list[dict]:
    return [{**line, "adapter": adapter} for line in lines]


def sampled_reward(client: pipeline.Client, renderer: Any, lines: list[dict], *, run: str,
                   output: str | None) -> tuple[float, Any]:
    batch = client.submit(lines, run=run, output=output, tokenizer=renderer)
    batch.wait(timeout=1800, progress=False)
    table = batch.read(COLUMNS).sort_by([("request_id", "ascending"), ("sample_index", "ascending")])
    return float(rewards_of(table).mean()), table


def lora_loop(client: pipeline.Client, model_dir: str | Path, settings: Settings, *, run: str, output: str | None,
              adapter: str = "grpo", rank: int = 16, lr: float = 5e-4, log: Any = print) -> LoraResult:
    """Train a LoRA adapter with GRPO through the pool's workers, pushing it after every step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.core.weights.store import WeightStore
    from pipeline.core.weights.torch_bits import state_dict_bits
    from pipeline.submit.render import ChatRenderer
    from pipeline.weights.writer import write_version

    torch.manual_seed(settings.seed)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="full-push-") as tmp:  # the baseline: one full push's bytes and seconds
        started = time.perf_counter()
        full_bytes = write_version(WeightStore(f"file://{tmp}"), list(state_dict_bits(base.state_dict())), 1,
                                   delta=False).stored_bytes
        full_seconds = time.perf_counter() - started
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    first = push_adapter(client, model, adapter, base=str(model_dir))
    heldout_lines = on_adapter(requests(heldout_set(settings.heldout), tag="heldout", n=settings.heldout_samples,
                                        settings=settings, seed=99), adapter)
    before, _ = sampled_reward(client, renderer, heldout_lines, run=run, output=output)
    result = LoraResult(before, 0.0, push_bytes=first.stored_bytes, full_seconds=full_seconds, full_bytes=full_bytes)
    log(f"[lora] adapter {adapter} v{first.version}: held-out reward before {before:.3f}")
    draw = problems(random.Random(settings.seed), set(heldout_set(settings.heldout)))
    for step in range(settings.steps):
        pairs = [next(draw) for _ in range(settings.groups)]
        lines = on_adapter(requests(pairs, tag=f"s{step}", n=settings.samples, settings=settings,
                                    seed=settings.seed * 1000 + step), adapter)
        reward, table = sampled_reward(client, renderer, lines, run=run, output=output)
        train_step(model, optimizer, table, version=0, cap=settings.cap, max_grad_norm=settings.max_grad_norm)
        pushed = push_adapter(client, model, adapter, base=str(model_dir))
        result.rewards.append(reward)
        result.push_seconds.append(pushed.seconds)
        log(f"[lora] step {step}: reward {reward:.3f}, pushed {adapter} v{pushed.version} "
            f"({pushed.stored_bytes / 1e6:.2f} MB in {pushed.seconds:.3f} s)")
    after_lines = [{**line, "id": f"{line['id']}-after"} for line in heldout_lines]
    result.after, _ = sampled_reward(client, renderer, after_lines, run=run, output=output)
    log(f"[lora] held-out reward after {settings.steps} steps: {result.after:.3f}")
    return result


def summary(result: LoraResult) -> str:
    median = statistics.median(result.push_seconds) if result.push_seconds else float("nan")
    return (f"held-out reward {result.before:.3f} -> {result.after:.3f} in {len(result.rewards)} steps; "
            f"adapter push {result.push_bytes / 1e6:.2f} MB, median {median:.3f} s; a full push of the model "
            f"{result.full_bytes / 1e6:.1f} MB, {result.full_seconds:.2f} s "
            f"({result.full_bytes / max(1, result.push_bytes):.0f}x the bytes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter", default="grpo")
    parser.add_argument("--model", default=None, help="a transformers model directory (default: the demo model)")
    parser.add_argument("--redis", default=None, help="a Redis URL (default: $PIPELINE_REDIS_URL, else the "
                                                      "embedded server)")
    parser.add_argument("--pool", default=None, help="the pool (default: a fresh one)")
    parser.add_argument("--no-worker", action="store_true", help="start no worker: the pool's workers serve")
    args = parser.parse_args(argv)
    if args.model is None:
        from workers.engines.hf.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    from pipeline.core.broker.connection import connect_redis, resolve_url

    url = resolve_url(args.redis)
    pool = args.pool or f"learn-lora-{args.seed}-{int(time.time())}"
    client = pipeline.Client(connect_redis(url), pool)
    worker = None if args.no_worker else subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli.main", "worker", "--model", args.model, "--redis", url, "--pool", pool,
         "--new-pool", "--log-level", "WARNING"])
    try:
        result = lora_loop(client, args.model, Settings(steps=args.steps, seed=args.seed), run=f"{pool}-run",
                           output=None, adapter=args.adapter, rank=args.rank, lr=args.lr)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
