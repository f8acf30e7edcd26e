"""An RL loop on the sim engine, against the synchronous loop: how busy the engine stays, how fast.

    .venv/bin/python benchmarks/rl_loop.py [--steps 10] [--samples 512] [--repeats 3] [--step-ms 4]
        [--job-size 2] [--max-new-tokens 4096] [--train-fraction 0.5] [--max-staleness 1]
        [--prefill-tokens-per-s 50000] [--modes sync,drain,partial]

A real `RolloutWorker` on an embedded Redis serves a sim engine with 256 slots and lognormal
output lengths (median 300, p99 4000 tokens: `occupancy.py`'s configuration), weight loads of
50 ms. A trainer thread runs the loop; its step v trains on step v's `--samples` samples (one
run per step, n=1) and takes `--train-fraction` x the time the engine needs for a step's
samples at full occupancy (`loop_model.LoopConfig.train_s`, a sleep: the trainer's GPUs are not
the engine's), then pushes version v + 1. Work is admitted by staleness, AReaL's rule in steps:
step s's requests are submitted once the pool serves a version >= s - K (`--max-staleness`), so
no trained token is more than K versions older than the trainer (the largest lag is measured
from the rows and printed), and none is discarded.

- sync (the baseline, TRL's loop): K = 0: generate a step's samples, wait for all of them, train,
  push, submit the next step;
- drain: K steps ahead, pushes wait for every sample in flight to finish on the old weights;
- partial: K steps ahead, `push_weights(..., mode="partial")`: samples in flight stop, the weights
  load, the samples continue on the new weights (paying the re-prefill of prompt + tokens so far
  at `--prefill-tokens-per-s`, the sim's prefix cache being cleared by a swap).

Jobs are small (`--job-size 2`): a job commits when its last sample finishes. The worker keeps up
to 256 jobs in flight. Busy fraction = the engine's busy slot-steps / capacity slot-steps from the
first submit until the last step's push is acknowledged (swaps and training included); samples/s
= trained samples over that window. Prints medians over repeats with their range, the load
average, the ratio of each mode's samples/s to the synchronous loop's in the same repeat, and the
loop model's prediction at the same settings (`loop_model.py`, labelled as the model's). These are
the sim's figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pyarrow.compute as pc
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pipeline  # noqa: E402
from benchmarks.loop_model import LoopConfig, simulate, synchronous  # noqa: E402
from pipeline.core.broker import commit_log  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.core.shards import read_rollouts  # noqa: E402
from workers.engines.sim.engine import SimConfig, SimEngine  # noqa: E402
from workers.process.worker import RolloutWorker  # noqa: E402


class Loop(NamedTuple):
    """One loop's figures (the sim engine's)."""

    busy: float  # the engine's busy fraction
    samples_per_s: float
    seconds: float
    mixed_rows: int  # trained rows with tokens of several versions
    max_lag: int  # the trainer's version minus the oldest version of any token it trained on
    prefill_s: float  # seconds the engine stalled for prefill


def model_config(args: argparse.Namespace, mode: str) -> LoopConfig:
    """The loop model's configuration of this loop (`benchmarks/loop_model.py`)."""
    config = LoopConfig(steps=args.steps, samples=args.samples, max_new_tokens=args.max_new_tokens, prompt_tokens=16,
                        step_s=args.step_ms / 1000, job_size=args.job_size, train_fraction=args.train_fraction,
                        prefill_tokens_per_s=args.prefill_tokens_per_s, max_staleness=args.max_staleness,
                        policy="in_order", mode="drain" if mode == "drain" else "partial")
    return synchronous(config) if mode == "sync" else config


def run(conn: redis.Redis, output: str, mode: str, args: argparse.Namespace, seed: int) -> Loop:
    """One loop's figures."""
    steps, samples, job_size = args.steps, args.samples, args.job_size
    ahead = 0 if mode == "sync" else args.max_staleness
    train_s = model_config(args, mode).train_s
    conn.flushall()
    client = pipeline.Client(conn)
    engine = SimEngine(SimConfig(capacity=256, step_s=args.step_ms / 1000, median_tokens=300, p99_tokens=4000,
                                 load_s=0.05, prefill_tokens_per_s=args.prefill_tokens_per_s))
    runs = [f"rl-{mode}-{seed}-s{step}" for step in range(steps + ahead)]
    result: dict[str, float] = {}
    errors: list[BaseException] = []

    def submit(step: int) -> None:
        if step >= len(runs):
            return
        lines = [{"id": f"q{i}", "input_ids": [1 + i % 1000] * 16,
                  "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                      "seed": seed * 1_000_000 + step * 10_000 + i}}
                 for i in range(samples)]
        client.submit(lines, run=runs[step], output=output, batch_size=job_size)

    # The first steps are queued before the worker starts: an idle worker exits (max_idle_time),
    # and on a loaded machine the first submit could take longer than that.
    engine.reset_stats()
    started = time.perf_counter()
    for step in range(ahead + 1):  # version 0 admits steps 0..K
        submit(step)

    # A drain push waits for the longest sample in flight: up to the cap's decode time, and more on a loaded machine.
    push_timeout = max(60.0, 3 * args.max_new_tokens * args.step_ms / 1000)
    push_mode = "partial" if mode == "partial" else "drain"

    def trainer() -> None:
        try:
            for step in range(steps):
                while commit_log.totals(conn, runs[step]).rows < samples:
                    time.sleep(0.005)
                time.sleep(train_s)  # the trainer's step; the engine goes on with the steps admitted ahead
                client.push_weights(f"/ckpt/v{step + 1}", version=step + 1, mode=push_mode,  # type: ignore[arg-type]
                                    timeout=push_timeout)
                submit(step + 1 + ahead)  # version step + 1 admits step step + 1 + K
            result["seconds"] = time.perf_counter() - started
            stats = engine.stats()
            result["busy"], result["prefill_s"] = stats.utilisation, stats.prefill_s
            for name in runs[steps:]:  # admitted ahead, never trained: the worker need not finish them
                client.cancel(name)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        RolloutWorker(conn, engine, control_poll_s=0.05, max_jobs_in_flight=args.max_jobs_in_flight).work(
            burst=False, max_idle_time=int(train_s) + 2, with_scheduler=False, logging_level="WARNING")
    finally:
        thread.join(timeout=900)
        engine.close()
    if errors:
        raise errors[0]
    mixed, lag = 0, 0
    for step in range(steps):
        table = read_rollouts(output, runs[step], columns=["weight_version", "weight_version_segments"])
        mixed += table.num_rows - table.column("weight_version_segments").null_count
        lag = max(lag, step - int(pc.min(table.column("weight_version")).as_py()))
    return Loop(result["busy"], steps * samples / result["seconds"], result["seconds"], mixed, lag,
                result["prefill_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the first repeat's seed (repeat i uses seed + i)")
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--job-size", type=int, default=2, help="requests per job (a job commits as one shard)")
    parser.add_argument("--max-new-tokens", type=int, default=4096,
                        help="the cap on each sample's length, as real runs set one (the lognormal tail is cut there)")
    parser.add_argument("--train-fraction", type=float, default=0.5,
                        help="the trainer's step as a share of a step's generation time at full occupancy")
    parser.add_argument("--max-staleness", type=int, default=1, help="K: steps admitted ahead of the trainer")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=SimConfig.prefill_tokens_per_s,
                        help="the sim's prefill rate: a continuation after a partial swap re-computes prompt + "
                             "generated tokens (its prefix cache is cleared by the swap); 0: free")
    parser.add_argument("--max-jobs-in-flight", type=int, default=256,
                        help="the worker's limit (a job waiting for its long sample keeps its place)")
    parser.add_argument("--modes", default="sync,drain,partial", help="comma-separated; sync is the baseline")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "sync" not in modes:
        modes.insert(0, "sync")
    figures: dict[str, list[Loop]] = {mode: [] for mode in modes}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        output = f"file://{tmp}/shards"
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]  # rotated each repeat
            for mode in order:
                figures[mode].append(run(conn, output, mode, args, args.seed + repeat))
                loads.append(os.getloadavg()[0])

    def median(mode: str, field: str) -> float:
        return statistics.median(getattr(f, field) for f in figures[mode])

    setup = (f"{args.steps} steps x {args.samples} samples (n=1, jobs of {args.job_size}), 256 slots, lognormal median "
             f"300 p99 4000 capped at {args.max_new_tokens}, {args.step_ms:g} ms steps, 50 ms loads, prefill "
             f"{args.prefill_tokens_per_s:,.0f} tokens/s, trainer {args.train_fraction:g} x a step's generation "
             f"({model_config(args, 'sync').train_s:.2f} s), K = {args.max_staleness}, median of {args.repeats}")
    print(f"rl loop ({setup}; figures of the sim engine; load average {min(loads):.1f}-{max(loads):.1f})")
    for mode in modes:
        busy = [f.busy for f in figures[mode]]
        ratios = [f.samples_per_s / b.samples_per_s for f, b in zip(figures[mode], figures["sync"], strict=True)]
        predicted = simulate(model_config(args, mode))
        print(f"  {mode:7s}: {median(mode, 'busy'):.1%} busy (min {min(busy):.1%}, max {max(busy):.1%}), "
              f"{median(mode, 'samples_per_s'):.0f} samples/s, {statistics.median(ratios):.2f}x sync "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}), {median(mode, 'seconds'):.1f} s, largest lag "
              f"{max(f.max_lag for f in figures[mode])} (bound {0 if mode == 'sync' else args.max_staleness}), "
              f"{median(mode, 'mixed_rows'):.0f} rows with tokens of two or more versions, "
              f"{median(mode, 'prefill_s'):.1f} s stalled for prefill | the model: {predicted.busy:.1%} busy, "
              f"{predicted.samples_per_s:.0f} samples/s")


if __name__ == "__main__":
    main()
