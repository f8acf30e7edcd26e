"""LoRA adapters on the demo model: an adapter push against a full push, and mixed batches.

    .venv/bin/python benchmarks/adapters.py [--rank 16] [--repeats 3] [--requests 16] [--tokens 16]

On the demo model (SmolLM2-135M-Instruct, float32, converted once into the model cache):

- push, bytes and time: a rank-`--rank` LoRA adapter on q/k/v/o_proj written as a new version
  into an adapter store (`pipeline.weights.adapter_push`: checked against the base shapes,
  stored in full) against the full model written as a new version of a weight store
  (`pipeline.weights.writer.write_version`, full: what a first push or `--delta` off stores);
- the worker-side pause, hf engine: the adapter read from its store and injected with peft
  (`AdapterCache.ensure`, what runs before a batch naming a new version) against a full store
  version applied in place (`HFEngine.apply_store_version` from no version: every tensor read,
  checked and copied);
- throughput of one batch of `--requests` greedy requests of `--tokens` tokens each, all on the
  base, against the same batch with the requests spread over 1, 4 and 16 adapters (round-robin;
  the adapters resident before the timing).

Medians over `--repeats`, min-max in parentheses. Redis is the embedded server in a temporary
directory; nothing else runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.adapter_check import base_shapes_of_dir, from_model
from pipeline.weights.adapter_push import push_adapter_tensors
from pipeline.weights.writer import write_version
from schemas.request import RolloutRequest
from workers.engines.hf.demo_model import ensure_demo_model
from workers.engines.hf.engine import HFEngine
from workers.jobs.adapters import pin_adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _stat(values: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    scaled = [v * scale for v in values]
    return f"{fmt.format(statistics.median(scaled))} ({fmt.format(min(scaled))}-{fmt.format(max(scaled))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    model_dir = ensure_demo_model()
    root = Path(tempfile.mkdtemp(prefix="adapters-bench-"))
    server = RedisServer(root / "redis")
    server.ensure_started()
    conn = server.client()
    try:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        full_bits = list(state_dict_bits(base.state_dict()))
        shapes = base_shapes_of_dir(model_dir)
        config = LoraConfig(r=args.rank, target_modules=TARGETS, init_lora_weights=False)
        torch.manual_seed(0)
        lora = get_peft_model(base, config)
        for index in range(1, 16):
            lora.add_adapter(f"a{index}", config)
        adapters = [from_model(lora, "default"), *(from_model(lora, f"a{i}") for i in range(1, 16))]
        del lora, base
        full_s, adapter_s, full_bytes, adapter_bytes = [], [], 0, 0
        for repeat in range(args.repeats):
            store = WeightStore(f"file://{root}/full-{repeat}")
            started = time.perf_counter()
            full_bytes = write_version(store, full_bits, 1, delta=False).stored_bytes
            full_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            adapter_bytes = push_adapter_tensors(conn, f"a{repeat}", adapters[0], base=shapes, pool="bench",
                                                 store=f"file://{root}/pool").stored_bytes
            adapter_s.append(time.perf_counter() - started)
        print(f"push bytes: adapter (rank {args.rank}, {', '.join(TARGETS)}) {adapter_bytes / 1e6:.2f} MB, "
              f"full model {full_bytes / 1e6:.1f} MB: {adapter_bytes / full_bytes:.4f} of a full push")
        print(f"push seconds (writer side): adapter {_stat(adapter_s)}, full {_stat(full_s)}")

        engine = HFEngine(model_dir, max_adapters=32)
        for index, adapter in enumerate(adapters):
            push_adapter_tensors(conn, f"m{index}", adapter, base=shapes, pool="bench", store=f"file://{root}/pool")
        load_s, apply_s = [], []
        for repeat in range(args.repeats):
            [pinned] = pin_adapters([RolloutRequest(id="x", input_ids=[1], adapter=f"a{repeat}")], engine, conn,
                                    "bench")
            started = time.perf_counter()
            engine.adapters.ensure([pinned.adapter])
            load_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.apply_store_version(WeightStore(f"file://{root}/full-{repeat}"), None, 1)
            apply_s.append(time.perf_counter() - started)
        print(f"worker pause, hf: adapter loaded from its store {_stat(load_s)} s, full version applied in place "
              f"{_stat(apply_s)} s")

        def batch(adapter_count: int) -> list[RolloutRequest]:
            return [RolloutRequest(id=f"r{i}", input_ids=[1, 504 + i, 28, 4301 + i],
                                   adapter=None if adapter_count == 0 else f"m{i % adapter_count}",
                                   sampling_params={"temperature": 0.0, "max_new_tokens": args.tokens,
                                                    "ignore_eos": True}) for i in range(args.requests)]

        rates: dict[int, list[float]] = {count: [] for count in (0, 1, 4, 16)}
        for _ in range(args.repeats):
            for count in rates:  # interleaved: every mix sees the same load
                requests = pin_adapters(batch(count), engine, conn, "bench")
                engine.adapters.ensure(r.adapter for r in requests if r.adapter)
                started = time.perf_counter()
                outputs = engine.generate(requests)
                seconds = time.perf_counter() - started
                rates[count].append(sum(len(o[0].token_ids) for o in outputs) / seconds)
        base_rate = statistics.median(rates[0])
        for count, values in rates.items():
            label = "base only" if count == 0 else f"{count} adapter(s)"
            print(f"batch of {args.requests} x {args.tokens} tokens, {label}: {_stat(values, fmt='{:.0f}')} tokens/s, "
                  f"{statistics.median(values) / base_rate:.2f}x the base")
        engine.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
