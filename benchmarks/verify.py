"""`pipeline verify` on the demo model: agreement figures, and speed against its ceiling.

    .venv/bin/python benchmarks/verify.py [--requests 8] [--tokens 32] [--repeats 3] [--threads 0]

Generates a shard with the hf engine on the demo model (SmolLM2-135M-Instruct, v0), and one on
its perturbed copy (the demo's v1), then prints:

- agreement: v0 rows checked against v0 (max |Δ| ≤ 1e-3, k3 ≈ 0 expected), v1 rows against
  v0 (a clear mismatch), with the exit decision of `--max-abs-diff 1e-3`;
- speed, over the same rows and tokens, median of `--repeats`: `verify` on a model loaded once
  beforehand (its loader is handed the loaded model, so no load is timed and none is subtracted),
  the ceiling — a bare batched forward pass of the same model over the same left-padded groups,
  nothing else — and a one-row-at-a-time loop (a forward and a log-softmax per row). Goals: ≥ 80 %
  of the ceiling, ≥ 5x the loop.
- the share of verify's own time spent in the model's forward (timed by hooks on the model inside
  the verify call): what the ceiling ratio means, measured so that it cannot exceed 100 %. (The
  issue-16 figure, 107 %, subtracted a separately timed load from verify's time.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from schemas.request import RolloutRequest
from workers.audit import recompute
from workers.audit.recompute import DEFAULT_MEMORY_MB, _groups_by_memory, _rows_of, exceeded, verify
from workers.engines.hf.demo_model import ensure_demo_model, ensure_perturbed_copy
from workers.engines.hf.engine import HFEngine
from workers.rows.table import RowContext, build_table


def make_shard(model: Path, version: int, out: Path, requests: int, tokens: int) -> Path:
    engine = HFEngine(model, weight_version=version)
    rng = np.random.default_rng(version)
    lines = [RolloutRequest.model_validate({
        "id": f"r{i}", "input_ids": rng.integers(100, 20_000, size=int(rng.integers(8, 40))).tolist(),
        "sampling_params": {"max_new_tokens": tokens, "seed": i, "ignore_eos": True,
                            "temperature": [1.0, 0.7, 0.0][i % 3]}}) for i in range(requests)]
    outputs = engine.generate(lines)
    now = datetime.now(UTC)
    ctx = RowContext(run="bench", job_id=f"v{version}", engine="hf", model=str(model), worker_id="bench",
                     weight_version=version, submitted_at=now, started_at=now, finished_at=now)
    path = out / f"v{version}" / "shard.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(build_table(lines, outputs, ctx), path)
    engine.close()
    return path.parent


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    v0 = ensure_demo_model()
    v1 = ensure_perturbed_copy(v0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        shard_v0 = make_shard(v0, 0, out, args.requests, args.tokens)
        shard_v1 = make_shard(v1, 1, out, args.requests, args.tokens)

        for label, shard in (("v0 rows vs v0", shard_v0), ("v1 rows vs v0", shard_v1)):
            report = verify(str(shard), str(v0))
            (s,) = report.table.to_pylist()
            print(f"{label}: tokens={s['tokens']} mean|Δ|={s['mean_abs_diff']:.2e} max|Δ|={s['max_abs_diff']:.2e} "
                  f"k3={s['k3']:.2e} ratio p99={s['ratio_p99']:.3f}; --max-abs-diff 1e-3 exits "
                  f"{1 if exceeded(report, 1e-3) else 0}")

        engine = HFEngine(v0)
        table = pq.read_table(next(shard_v0.glob("*.parquet")))
        rows = list(_rows_of(table.to_batches()[0], engine.vocab_size, {}))
        tokens = sum(len(r.completion) for r in rows)
        groups = list(_groups_by_memory(rows, engine.vocab_size, DEFAULT_MEMORY_MB, 64))
        prepared = []
        for group in groups:
            fed = [np.concatenate([r.prompt, r.completion[:-1]]) for r in group]
            width = max(len(f) for f in fed)
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for i, f in enumerate(fed):
                ids[i, width - len(f):] = torch.from_numpy(f)
                mask[i, width - len(f):] = 1
            prepared.append((ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), max(len(r.completion) for r in group)))

        def bare() -> None:
            with torch.inference_mode():
                for ids, mask, positions, keep in prepared:
                    engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                                 logits_to_keep=keep)

        def one_row() -> None:
            with torch.inference_mode():
                for r in rows:
                    fed = torch.from_numpy(np.concatenate([r.prompt, r.completion[:-1]]))[None]
                    logits = engine.model(input_ids=fed, use_cache=False).logits[0, len(r.prompt) - 1:].float()
                    scaled = logits if r.params.greedy else logits / r.params.temperature
                    target = torch.from_numpy(r.completion)
                    (scaled.gather(1, target[:, None])[:, 0] - torch.logsumexp(scaled, -1)).numpy()

        # verify's loader hands out this loaded checker (closed at the end, not by each call), and
        # hooks on its model add up the time verify spends inside the forward.
        checker = recompute._Checker(str(v0), "cpu")
        in_forward = [0.0]
        started: list[float] = []
        checker.engine.model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        checker.engine.model.register_forward_hook(
            lambda *_: in_forward.__setitem__(0, in_forward[0] + time.perf_counter() - started.pop()))
        close, checker.close = checker.close, lambda: None
        recompute._Checker = lambda path, device: checker  # type: ignore[assignment,misc]

        def verify_loaded() -> None:
            verify(str(shard_v0), str(v0))

        # Interleaved, so a busy machine slows every method alike; CPU time beside wall time.
        samples: dict[str, list[tuple[float, float]]] = {"verify": [], "bare": [], "loop": []}
        forward_share: list[float] = []
        for _ in range(args.repeats):
            in_forward[0] = 0.0
            samples["verify"].append(timed(verify_loaded))
            forward_share.append(in_forward[0] / samples["verify"][-1][0])
            samples["bare"].append(timed(bare))
            samples["loop"].append(timed(one_row))
        close()
        wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
        print(f"speed over {len(rows)} rows, {tokens} completion tokens, median of {args.repeats} interleaved "
              "(verify on a model loaded beforehand):")
        for name, label in (("verify", "verify"), ("bare", "bare forward (ceiling)"), ("loop", "one row a time")):
            walls = [w for w, _ in samples[name]]
            print(f"  {label:<24} wall {wall[name]:7.3f} s (min {min(walls):.3f}, max {max(walls):.3f}; "
                  f"{tokens / wall[name]:7.0f} tokens/s)  cpu {cpu[name]:7.3f} s")
        print(f"verify / ceiling = {wall['bare'] / wall['verify']:.0%} wall, {cpu['bare'] / cpu['verify']:.0%} cpu "
              f"(goal >= 80%); verify vs one-row loop = {wall['loop'] / wall['verify']:.1f}x wall, "
              f"{cpu['loop'] / cpu['verify']:.1f}x cpu (goal >= 5x)")
        print(f"share of verify's time inside the model's forward: {statistics.median(forward_share):.0%} "
              f"(min {min(forward_share):.0%}, max {max(forward_share):.0%}; at most 100 % by construction)")
        engine.close()


if __name__ == "__main__":
    main()
