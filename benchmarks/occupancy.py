"""Engine occupancy: how busy a worker keeps a continuous-batching engine (the sim engine).

    .venv/bin/python benchmarks/occupancy.py [--jobs 40] [--baseline-jobs 3] [--repeats 3] [--step-ms 1]

A real `RolloutWorker` (burst mode) on an embedded Redis serves jobs of 64 requests (n=1) on a
sim engine with 256 slots and lognormal output lengths (median 300, p99 4000 tokens); shards
are written to a temporary directory and committed as in production. Utilisation is the
engine's own busy slot-steps / capacity slot-steps, from the first job until the last job
reached the engine (the queue is then empty: what follows is the unavoidable final drain,
reported apart as "with drain").

- ours: the worker feeds the next jobs while the last long sequences of a job finish;
- baseline: no feeding, one job at a time with a barrier at each job's end, with jobs of
  256 requests, the engine's capacity, so that each job can fill every slot and the ratio
  measures feeding, not job size (what stays idle is the barrier's wait for each job's
  longest sequence); the same with 64-request jobs (which can fill at most a quarter of
  the slots) is printed too, as the earlier baseline.

Prints medians over repeats and the ratio. Goal: >= 95 % busy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import redis

import pipeline
from pipeline.core.broker.redis_server import RedisServer
from schemas.request import RolloutRequest
from workers.engines.sim.engine import SimConfig, SimEngine, SimStats
from workers.process.worker import RolloutWorker

REQUESTS_PER_JOB = 64
CAPACITY = 256


class MeasuredSim(SimEngine):
    """Notes the engine's counters at every submit, so the window can end at the last one."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.at_submit: list[SimStats] = []

    def submit(self, requests: Sequence[RolloutRequest]) -> Future:
        future = super().submit(requests)
        self.at_submit.append(self.stats())
        return future


def run(conn: redis.Redis, output: str, jobs: int, step_s: float, feed: bool, seed: int,
        per_job: int = REQUESTS_PER_JOB) -> tuple[float, float, float]:
    conn.flushall()
    lines = [{"id": f"q{i}", "input_ids": [1 + i % 1000] * 16,
              "sampling_params": {"max_new_tokens": 100_000, "seed": seed * 1_000_000 + i}} for i in range(
        jobs * per_job)]
    batch = pipeline.Client(conn).submit(lines, run=f"occ-{seed}-{int(feed)}-{per_job}", output=output,
                                         batch_size=per_job)
    engine = MeasuredSim(SimConfig(capacity=CAPACITY, step_s=step_s, median_tokens=300, p99_tokens=4000))
    try:
        engine.reset_stats()
        started = time.perf_counter()
        RolloutWorker(conn, engine, feed=feed).work(burst=True, with_scheduler=False, logging_level="WARNING")
        seconds = time.perf_counter() - started
        steady = engine.at_submit[-1]
        overall = engine.stats()
    finally:
        engine.close()
    assert batch.wait(timeout=60).counts["finished"] == jobs
    return steady.utilisation, overall.utilisation, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--baseline-jobs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        output = f"file://{tmp}/shards"
        ours = [run(conn, output, args.jobs, args.step_ms / 1000, True, r) for r in range(args.repeats)]
        full = [run(conn, output, args.baseline_jobs, args.step_ms / 1000, False, r, CAPACITY)
                for r in range(args.repeats)]
        base = [run(conn, output, args.baseline_jobs, args.step_ms / 1000, False, r) for r in range(args.repeats)]
    ours_m = statistics.median(u for u, _, _ in ours)
    full_m = statistics.median(u for u, _, _ in full)
    base_m = statistics.median(u for u, _, _ in base)
    print(f"occupancy: {ours_m:.1%} busy (median of {args.repeats}; {args.jobs} jobs x {REQUESTS_PER_JOB} requests, "
          f"256 slots, lognormal median 300 p99 4000, {args.step_ms:g} ms steps; first job to last job fed)")
    print(f"  with the final drain: {statistics.median(o for _, o, _ in ours):.1%}; "
          f"wall {statistics.median(s for _, _, s in ours):.1f} s")
    print(f"baseline one job at a time (barrier), capacity-sized jobs of {CAPACITY}: {full_m:.1%} busy "
          f"({args.baseline_jobs} jobs, first job to last job fed)")
    print(f"ratio: {ours_m / full_m:.1f}x")
    print(f"earlier baseline, one job of {REQUESTS_PER_JOB} at a time: {base_m:.1%} busy "
          f"(ratio {ours_m / base_m:.1f}x)")


if __name__ == "__main__":
    main()
