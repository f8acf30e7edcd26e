"""An RL loop on the sim engine: how busy the engine stays across weight swaps, partial vs drain.

    .venv/bin/python benchmarks/rl_loop.py [--steps 10] [--samples 512] [--repeats 3] [--step-ms 4] [--job-size 2]
        [--max-new-tokens 16384] [--prefill-tokens-per-s 50000]

A real `RolloutWorker` on an embedded Redis serves a sim engine with 256 slots and lognormal
output lengths (median 300, p99 4000 tokens: `occupancy.py`'s configuration), weight loads of
50 ms. A trainer thread runs the loop as asynchronous RL trainers do: each step consumes the
next `--samples` finished samples (n=1, in commit order, whichever request they answer), then
pushes the next weight version. It submits the next step's requests as soon as the current
step's are all submitted (one step ahead), so a long sample that is not done when its step
closes carries over to a later one (with tokens of several versions in partial mode).

Jobs are small (`--job-size 2`): a job commits when its last sample finishes, so with 64
requests a job the step would wait for the longest of 64 and the trainer could not consume
finished samples early, whatever the swap mode (finished samples waiting for a long sibling
are work the engine no longer has). The worker keeps up to 256 jobs in flight (a job waiting
for its long sample holds its place). Decode steps are 4 ms so that the per-job bookkeeping
(RQ, a shard per job) on a shared 2-core VM does not throttle the simulated engine.

- partial: `push_weights(..., mode="partial")`: samples in flight stop, the weights load, the
  samples continue on the new weights;
- baseline drain (today's default): every sample in flight finishes on the old weights first.

Busy fraction = the engine's busy slot-steps / capacity slot-steps over the whole loop (the
first submit until the last step's samples are in and its push is acknowledged), swaps
included. Also samples/s over the same window, and how many rows hold tokens of two or more
versions (of all the run's rows: (steps + 1) x samples, the last step's submitted one step ahead).
Prints medians over repeats (with the range of the busy fraction) and the ratio. Goal: >= 90 % busy
in partial mode. These are the sim's figures: it pays a prefill of prompt + generated tokens when a
sample continues after a swap (`SimConfig.prefill_tokens_per_s`; its prefix cache is cleared by a
swap), and lengths are capped at `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import redis

import pipeline
from pipeline.core.broker import commit_log
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.shards import read_rollouts
from workers.engines.sim import SimConfig, SimEngine
from workers.process.worker import RolloutWorker


class Loop(NamedTuple):
    """One loop's figures (the sim engine's)."""

    busy: float  # the engine's busy fraction
    samples_per_s: float
    seconds: float
    mixed_rows: int  # rows with tokens of several versions
    rows: int
    prefill_s: float  # seconds the engine stalled for prefill


def run(conn: redis.Redis, output: str, mode: str, args: argparse.Namespace, seed: int) -> Loop:
    """One loop's figures."""
    steps, samples, job_size = args.steps, args.samples, args.job_size
    conn.flushall()
    client = pipeline.Client(conn)
    engine = SimEngine(SimConfig(capacity=256, step_s=args.step_ms / 1000, median_tokens=300, p99_tokens=4000,
                                 load_s=0.05, prefill_tokens_per_s=args.prefill_tokens_per_s))
    run_name = f"rl-{mode}-{seed}"
    result: dict[str, float] = {}
    errors: list[BaseException] = []

    def submit(step: int) -> None:
        lines = [{"id": f"s{step}-q{i}", "input_ids": [1 + i % 1000] * 16,
                  "sampling_params": {"max_new_tokens": args.max_new_tokens,
                                      "seed": seed * 1_000_000 + step * 10_000 + i}}
                 for i in range(samples)]
        client.submit(lines, run=run_name, output=output, batch_size=job_size)

    # The first step is queued before the worker starts: a worker idle for a second exits
    # (max_idle_time), and on a loaded machine the first submit could take longer than that.
    engine.reset_stats()
    started = time.perf_counter()
    submit(0)

    # A drain push waits for the longest sample in flight: up to the cap's decode time, and more on a loaded machine.
    push_timeout = max(60.0, 3 * args.max_new_tokens * args.step_ms / 1000)

    def trainer() -> None:
        try:
            for step in range(steps):
                submit(step + 1)  # one step ahead
                needed = (step + 1) * samples
                while commit_log.totals(conn, run_name).rows < needed:
                    time.sleep(0.005)
                client.push_weights(f"/ckpt/v{step + 1}", version=step + 1, mode=mode, timeout=push_timeout)  # type: ignore[arg-type]
            result["seconds"] = time.perf_counter() - started
            stats = engine.stats()
            result["busy"], result["prefill_s"] = stats.utilisation, stats.prefill_s
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        RolloutWorker(conn, engine, control_poll_s=0.05, max_jobs_in_flight=args.max_jobs_in_flight).work(
            burst=False, max_idle_time=1, with_scheduler=False, logging_level="WARNING")
    finally:
        thread.join(timeout=900)
        engine.close()
    if errors:
        raise errors[0]
    table = read_rollouts(output, run_name, columns=["weight_version_segments"])
    # Every row of the run: the last step's requests (submitted one step ahead) are generated too.
    mixed = table.num_rows - table.column("weight_version_segments").null_count
    return Loop(result["busy"], steps * samples / result["seconds"], result["seconds"], mixed, table.num_rows,
                result["prefill_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the first repeat's seed (repeat i uses seed + i)")
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--job-size", type=int, default=2, help="requests per job (a job commits as one shard)")
    parser.add_argument("--max-new-tokens", type=int, default=16_384,
                        help="the cap on each sample's length, as real runs set one (the lognormal tail is cut there)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=SimConfig.prefill_tokens_per_s,
                        help="the sim's prefill rate: a continuation after a partial swap re-computes prompt + "
                             "generated tokens (its prefix cache is cleared by the swap); 0: free")
    parser.add_argument("--max-jobs-in-flight", type=int, default=256,
                        help="the worker's limit (a job waiting for its long sample keeps its place)")
    args = parser.parse_args()
    figures: dict[str, list[Loop]] = {"partial": [], "drain": []}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        output = f"file://{tmp}/shards"
        for repeat in range(args.repeats):
            for mode in ("partial", "drain"):
                figures[mode].append(run(conn, output, mode, args, args.seed + repeat))

    def median(mode: str, field: str) -> float:
        return statistics.median(getattr(f, field) for f in figures[mode])

    setup = (f"{args.steps} steps x {args.samples} samples (n=1, jobs of {args.job_size}), 256 slots, lognormal median "
             f"300 p99 4000 capped at {args.max_new_tokens}, {args.step_ms:g} ms steps, 50 ms loads, prefill "
             f"{args.prefill_tokens_per_s:,.0f} tokens/s, median of {args.repeats}")
    print(f"rl loop ({setup}; figures of the sim engine)")
    for mode in ("partial", "drain"):
        busy = [f.busy for f in figures[mode]]
        print(f"  {mode:7s}: {median(mode, 'busy'):.1%} busy (min {min(busy):.1%}, max {max(busy):.1%}), "
              f"{median(mode, 'samples_per_s'):.0f} samples/s, {median(mode, 'seconds'):.1f} s, "
              f"{median(mode, 'mixed_rows'):.0f} of {median(mode, 'rows'):.0f} rows with tokens of two or more "
              f"versions, {median(mode, 'prefill_s'):.1f} s stalled for prefill")
    print(f"ratio partial/drain: busy {median('partial', 'busy') / median('drain', 'busy'):.1f}x, "
          f"samples/s {median('partial', 'samples_per_s') / median('drain', 'samples_per_s'):.1f}x")


if __name__ == "__main__":
    main()
