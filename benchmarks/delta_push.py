"""Weight pushes from memory as deltas: bytes per push and the hf engine's pause, against full pushes.

    .venv/bin/python benchmarks/delta_push.py [--steps 3] [--lr 1e-6] [--store-gbps 10] [--nccl-gbps 100]

On the demo model (SmolLM2-135M-Instruct, converted once into the model cache; nothing is
downloaded) a trainer takes real RL steps: the hf engine samples rollouts of a few chat prompts
(n=2, 24 tokens by default), each step is one padded backward pass of a REINFORCE loss (group-normalised random
rewards) over them and an AdamW step (lr 1e-6, weight decay 0, float32 master weights).
After every step the state dict is pushed into two weight stores (`pipeline.weights.writer`):

- bf16 (what an engine serving bf16 holds; the cast is the trainer's) and float32 (what the hf
  engine serves): bytes stored per push, delta against the full version (the first push), and
  how the per-tensor choice between the two encodings went (xor+zstd vs changed elements+zstd),
  with what each alone would have stored;
- engine pause, hf, as in a partial swap (the engine stopped between interrupt and resume), float32
  (what `HFEngine` serves) and bf16 (the same engine's model cast to bf16 in this script: HFEngine
  loads float32, so this is the install a bf16 engine would do, not a served configuration):
  * staged delta (what a worker does): `stage_store_version` (decode, XOR, checksums) runs before
    the pause, timed apart; the pause is `install_store_version` (a parameter swap for a tensor
    changed in most elements, the changed elements alone for the others);
  * in-place delta (`PIPELINE_WEIGHT_STAGING=off`, the previous behaviour): `apply_store_version`,
    all of it in the pause, on a second engine;
  * baseline "full reload today": what `pipeline weights push PATH` does, transformers'
    `from_pretrained` of the checkpoint the trainer saved, inside the pause (`HFEngine.update_weights`
    in float32; `from_pretrained(dtype=bf16)` of a bf16 checkpoint in bf16);
  * baseline "full reload staged", the same treatment as the delta: the checkpoint read into a state
    dict before the pause (`safetensors.torch.load_file`), the pause only `load_state_dict` (a copy
    of every tensor), and `load_state_dict(assign=True)` + `tie_weights()` (a swap of every tensor).
  The trainer-side costs (writing the delta; `save_pretrained`) are reported too.

Medians over the steps, with min-max. Then a paper model: seconds per push for 7 B, 32 B and
235 B parameters in bf16 from the measured bf16 byte ratio, at a stated store bandwidth (the
trainer writes, a worker reads: bytes / bandwidth each way) and a stated NCCL broadcast bandwidth
for a full push. These are arithmetic on the measured ratio, not measurements.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.core.weights import codec
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.writer import write_version
from schemas.request import RolloutRequest
from workers.engines.hf.demo_model import ensure_demo_model
from workers.engines.hf.engine import HFEngine

QUESTIONS = ["What is 17 + 25?", "Name a prime number above 50.", "Spell 'cat' backwards.",
             "What is the capital of France?", "Give a synonym of 'quick'.", "What is 9 times 7?"]
PAPER_MODELS = {"7B": 7e9, "32B": 32e9, "235B": 235e9}


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    return (f"{statistics.median(values) * scale:.3f} {unit} (min {min(values) * scale:.3f}, "
            f"max {max(values) * scale:.3f}, n={len(values)})")


def rollouts(engine: HFEngine, tokenizer, n: int, tokens: int) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    requests = []
    for i, question in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        requests.append(RolloutRequest.model_validate({
            "id": f"q{i}", "input_ids": ids,
            "sampling_params": {"max_new_tokens": tokens, "n": n, "temperature": 1.0, "seed": i}}))
    out = engine.generate(requests)
    return [(list(r.input_ids), list(s.token_ids)) for r, samples in zip(requests, out, strict=True) for s in samples]


def rl_step(model, optimizer, batch, rng: np.random.Generator, group: int) -> float:  # type: ignore[no-untyped-def]
    """One REINFORCE step over the batch as one padded forward and backward; advantages are
    group-normalised random rewards (a stand-in verifier)."""
    rewards = rng.random(len(batch)).reshape(-1, group)
    advantages = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1)
    width = max(len(p) + len(c) for p, c in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    weights = torch.zeros((len(batch), width - 1))
    for row, ((prompt, completion), advantage) in enumerate(zip(batch, advantages, strict=True)):
        sequence = prompt + completion
        ids[row, :len(sequence)] = torch.tensor(sequence)
        mask[row, :len(sequence)] = 1
        # Position t predicts token t+1: the completion's tokens, weighted by the advantage.
        weights[row, len(prompt) - 1:len(sequence) - 1] = float(advantage) / max(1, len(completion))
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(2, ids[:, 1:, None]).squeeze(-1)
    loss = -(logprobs * weights).sum() / len(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def encodings_by_dtype(before: dict[str, np.ndarray], after: dict[str, np.ndarray], dtype: str) -> dict[str, int]:
    """What each encoding alone would store for this step's change, and how often each wins per tensor."""
    sizes: Counter[str] = Counter()
    for name, new in after.items():
        old = before[name]
        if np.array_equal(old, new):
            sizes["wins:same"] += 1
            continue
        xor, sparse = len(codec.encode_xor(old, new)), len(codec.encode_sparse(old, new))
        sizes["xor_only"] += xor
        sizes["sparse_only"] += sparse
        sizes["wins:xor" if xor <= sparse else "wins:sparse"] += 1
        sizes["changed_elements"] += int(np.count_nonzero(old != new))
        sizes["elements"] += new.size
    sizes["dtype_" + dtype] = 1
    return dict(sizes)


def bits(state_dict, dtype) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {t.name: t.words for t in state_dict_bits(state_dict, dtype)}


def measure_pauses(engine: HFEngine, store: WeightStore, version: int, dtype: torch.dtype, checkpoint: Path, *,
                   reload_today: bool) -> dict[str, float]:
    """One push to `engine` (serving version-1): the delta staged (timed, not a pause) and installed
    (the pause), then the baselines' pauses loading `checkpoint` (the same bits)."""
    out: dict[str, float] = {}
    started = time.perf_counter()
    staged = engine.stage_store_version(store, version - 1, version)
    out["stage"] = time.perf_counter() - started
    out["staged_bytes"] = staged.staged_bytes
    started = time.perf_counter()
    applied = engine.install_store_version(staged)
    out["install"] = time.perf_counter() - started
    assert applied.how == "delta", applied
    started = time.perf_counter()
    if reload_today:
        engine.update_weights(str(checkpoint), version)  # what `pipeline weights push PATH` does
    else:
        AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)  # the same load, in bf16
    out["today"] = time.perf_counter() - started
    state = load_file(str(checkpoint / "model.safetensors"))  # before the pause, like the staged delta
    with torch.no_grad():
        started = time.perf_counter()
        engine.model.load_state_dict(state, strict=False)
        out["copy"] = time.perf_counter() - started
        state = load_file(str(checkpoint / "model.safetensors"))
        started = time.perf_counter()
        engine.model.load_state_dict(state, strict=False, assign=True)
        engine.model.tie_weights()
        out["assign"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt (the group)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--skip-encoding-analysis", action="store_true",
                        help="do not encode step 1 both ways to report which encoding wins (saves CPU on a busy host)")
    parser.add_argument("--store-gbps", type=float, default=10.0,
                        help="paper model: store bandwidth in GB/s (each way; e.g. NVMe-oF or 100 GbE)")
    parser.add_argument("--nccl-gbps", type=float, default=100.0,
                        help="paper model: NCCL broadcast bandwidth in GB/s of a full push (e.g. 8x400 Gb/s IB)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(model_dir)
    batch = rollouts(engine, tokenizer, args.samples, args.tokens)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer.train()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="delta-push-"))
    stores = {"bf16": WeightStore(str(work / "bf16")), "f32": WeightStore(str(work / "f32"))}
    casts = {"bf16": torch.bfloat16, "f32": None}
    previous = {kind: bits(trainer.state_dict(), casts[kind]) for kind in ("bf16", "f32")}
    full_bytes: dict[str, int] = {}
    for kind, store in stores.items():  # v0: the full version every delta is measured against
        full_bytes[kind] = write_version(store, state_dict_bits(trainer.state_dict(), casts[kind]), 0).stored_bytes
    engine.apply_store_version(stores["f32"], None, 0)
    in_place = HFEngine(model_dir)  # the in-place apply, side by side (it needs the engine at v-1)
    in_place.apply_store_version(stores["f32"], None, 0)
    engine_bf16 = HFEngine(model_dir)
    engine_bf16.model.to(torch.bfloat16)
    engine_bf16.apply_store_version(stores["bf16"], None, 0)

    delta_bytes: dict[str, list[int]] = {kind: [] for kind in stores}
    write_s: dict[str, list[float]] = {kind: [] for kind in stores}
    choice: dict[str, Counter[str]] = {kind: Counter() for kind in stores}
    pause: dict[str, list[float]] = {}
    staged_bytes: dict[str, list[int]] = {kind: [] for kind in stores}
    save_s: list[float] = []
    read_delta: list[int] = []
    print(f"v0 stored in full ({full_bytes['bf16'] / 1e6:.0f} MB bf16, {full_bytes['f32'] / 1e6:.0f} MB f32); "
          f"{len(batch)} rollouts", flush=True)
    for version in range(1, args.steps + 1):
        started = time.perf_counter()
        rl_step(trainer, optimizer, batch, rng, args.samples)
        print(f"step {version}: RL step {time.perf_counter() - started:.1f} s", flush=True)
        for kind, store in stores.items():
            # Each encoding alone, once: the choice is per tensor, this says why.
            if version == 1 and not args.skip_encoding_analysis:
                choice[kind].update(encodings_by_dtype(previous[kind], bits(trainer.state_dict(), casts[kind]), kind))
            started = time.perf_counter()
            written = write_version(store, state_dict_bits(trainer.state_dict(), casts[kind]), version,
                                    full_every=args.steps + 1)
            write_s[kind].append(time.perf_counter() - started)
            delta_bytes[kind].append(written.stored_bytes)
        checkpoint = work / f"ckpt-{version}"
        started = time.perf_counter()
        trainer.save_pretrained(checkpoint)
        save_s.append(time.perf_counter() - started)
        checkpoint_bf16 = work / f"ckpt-bf16-{version}"
        trainer.save_pretrained(checkpoint_bf16, state_dict={k: v.to(torch.bfloat16) for k, v in
                                                              trainer.state_dict().items()})
        # Each engine serves v-1: the delta staged then installed; the baselines then load v.
        for kind, target, dtype, ckpt in (("f32", engine, torch.float32, checkpoint),
                                          ("bf16", engine_bf16, torch.bfloat16, checkpoint_bf16)):
            timed = measure_pauses(target, stores[kind], version, dtype, ckpt, reload_today=kind == "f32")
            staged_bytes[kind].append(timed.pop("staged_bytes"))
            for name, seconds in timed.items():
                pause.setdefault(f"{kind}:{name}", []).append(seconds)
        started = time.perf_counter()
        applied = in_place.apply_store_version(stores["f32"], version - 1, version)
        pause.setdefault("f32:in_place", []).append(time.perf_counter() - started)
        assert applied.how == "delta", applied
        read_delta.append(applied.bytes_read)
        print(f"step {version}: bf16 delta {delta_bytes['bf16'][-1] / 1e6:.2f} MB, f32 delta "
              f"{delta_bytes['f32'][-1] / 1e6:.2f} MB; pauses "
              + ", ".join(f"{name} {values[-1]:.3f} s" for name, values in pause.items()), flush=True)

    print(f"\nDemo model {model_dir.name}, {args.steps} RL steps (REINFORCE + AdamW lr {args.lr:g}, "
          f"{len(batch)} rollouts of <= {args.tokens} tokens per step), torch threads {torch.get_num_threads()}")
    print("\nBytes per push (median over steps; min-max):")
    ratios = {}
    for kind in stores:
        ratio = [b / full_bytes[kind] for b in delta_bytes[kind]]
        ratios[kind] = statistics.median(ratio)
        c = choice[kind]
        print(f"  {kind:>4}: full {full_bytes[kind] / 1e6:.1f} MB, delta {spread(delta_bytes[kind], 'MB', 1e-6)}; "
              f"ratio delta/full {spread(ratio, '', 1.0)} = 1/{1 / ratios[kind]:.1f}")
        if c:
            print(f"        step 1: changed elements {c['changed_elements'] / max(1, c['elements']):.2%}; "
                  f"per tensor the smaller won: xor {c['wins:xor']}, sparse {c['wins:sparse']}, "
                  f"unchanged {c['wins:same']}; "
                  f"xor alone {c['xor_only'] / 1e6:.2f} MB, sparse alone {c['sparse_only'] / 1e6:.2f} MB (step 1)")
        print(f"        trainer-side write of the delta: {spread(write_s[kind])}")
    print(f"\nhf engine pause per push (as in a partial swap), same process; the delta reads "
          f"{statistics.median(read_delta) / 1e6:.1f} MB (f32) of the store:")
    for kind in stores:
        print(f"  {kind}: staged delta, before the pause (not paused): {spread(pause[f'{kind}:stage'])}; staged "
              f"memory {spread(staged_bytes[kind], 'MB', 1e-6)}")
        rows = [("staged delta: install (the pause)", "install"), ("in-place delta (staging off)", "in_place"),
                ("full reload today (from_pretrained in the pause)", "today"),
                ("full reload staged: load_state_dict copy", "copy"),
                ("full reload staged: load_state_dict assign (swap)", "assign")]
        for label, name in rows:
            if f"{kind}:{name}" in pause:
                print(f"    {label}: {spread(pause[f'{kind}:{name}'])}")
        install = statistics.median(pause[f"{kind}:install"])
        for name in ("today", "copy", "assign"):
            base = statistics.median(pause[f"{kind}:{name}"])
            share = f"1/{base / install:.0f}" if install < base else f"{install / base:.1f}x longer"
            print(f"    install / {name}: {install / base:.4f} ({share})")
    print(f"  the baseline's trainer also writes the checkpoint first: save_pretrained {spread(save_s)}")

    ratio = ratios["bf16"]
    print(f"\nPaper model (arithmetic, not measured): bf16 weights (2 bytes/param), measured bf16 delta ratio "
          f"{ratio:.4f}; store {args.store_gbps:g} GB/s each way (write, then read), NCCL {args.nccl_gbps:g} GB/s")
    print(f"  {'model':>6} {'full bytes':>11} {'full via store':>15} {'delta via store':>16} {'full NCCL':>10}")
    for name, params in PAPER_MODELS.items():
        full = 2 * params
        print(f"  {name:>6} {full / 1e9:>8.0f} GB {2 * full / (args.store_gbps * 1e9):>13.1f} s "
              f"{2 * full * ratio / (args.store_gbps * 1e9):>14.2f} s {full / (args.nccl_gbps * 1e9):>8.2f} s")


if __name__ == "__main__":
    main()
