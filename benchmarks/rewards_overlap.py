"""Rewards overlapping generation: a run with a 2 ms-a-row reward function, rows and rewards ready,
against generation alone and against rewards computed after generation in the trainer.

The reward function is CPU-bound by default (`--kind cpu`: it spins for its cost in CPU time, as a
verifier or a unit-test runner does, so it competes with the worker and Redis for the cores);
`--kind sleep` is the issue-17 function (`time.sleep`, a remote grader's latency, which never
competes). The three modes run `--repeats` times, interleaved; medians and ranges are printed.

One real redis-server; a burst `RolloutWorker` on the sim engine in this process generates each run
(the same requests each time); one `RewardWorker` process scores the rewarded run's shards while it
is generated. Three timings, in this order, from submit to:

- generation only: every job committed (no reward function);
- ours: every job committed and every job's rewards recorded (by the reward worker process);
- baseline: every job committed, then the trainer reads the rows and calls the same function on them.

Prints each time and the ratios to generation alone. Goal: ours within 1.1x.

    .venv/bin/python benchmarks/rewards_overlap.py [--requests 1024] [--cost-ms 2] [--kind cpu] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import redis

import pipeline
from pipeline.core.broker import reward_log
from pipeline.core.broker.redis_server import RedisServer
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker
from workers.rewards.reward_worker import RewardWorker

COST_S = 0.002


def sleepy(rows: list[dict]) -> list[float]:
    """A reward function costing COST_S a row (a grader's or a sandbox's latency)."""
    time.sleep(COST_S * len(rows))
    return [float(len(row["completion_token_ids"]) % 2) for row in rows]


def busy(rows: list[dict]) -> list[float]:
    """A reward function costing COST_S of CPU a row (a verifier computing on the core it runs on)."""
    end = time.thread_time() + COST_S * len(rows)
    while time.thread_time() < end:
        pass
    return [float(len(row["completion_token_ids"]) % 2) for row in rows]


REWARDS = {"cpu": busy, "sleep": sleepy}


def reward_loop(url: str, cost_s: float) -> None:
    global COST_S
    COST_S = cost_s
    RewardWorker(redis.Redis.from_url(url), block_ms=50, batch_rows=64).work()


def generate(conn: redis.Redis, args: argparse.Namespace) -> None:
    engine = SimEngine(SimConfig(capacity=args.capacity, step_s=args.step_ms / 1000, median_tokens=150,
                                 p99_tokens=600, seed=1))
    try:
        RolloutWorker(conn, engine).work(burst=True, with_scheduler=False, logging_level="WARNING")
    finally:
        engine.close()


def one_run(conn: redis.Redis, output: str, run: str, args: argparse.Namespace, mode: str) -> float:
    lines = [{"id": f"q{i}", "input_ids": [1 + i % 1000] * 16,
              "sampling_params": {"max_new_tokens": 100_000, "seed": i}} for i in range(args.requests)]
    batch = pipeline.Client(conn).submit(lines, run=run, output=output, batch_size=args.batch_size,
                                         reward=args.kind if mode == "ours" else None)
    started = time.perf_counter()
    generate(conn, args)
    assert batch.wait(timeout=600).counts["finished"] == len(batch.job_ids)
    if mode == "ours":
        while reward_log.totals(conn, run).jobs < len(batch.job_ids):
            conn.xread({f"pipeline:rewards:{run}": "$"}, block=50)
    elif mode == "baseline":
        table = batch.read(columns=["completion_token_ids"])
        rows = [{"completion_token_ids": ids} for ids in table.column("completion_token_ids").to_pylist()]
        for start in range(0, len(rows), 64):
            REWARDS[args.kind](rows[start : start + 64])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--cost-ms", type=float, default=2.0)
    parser.add_argument("--kind", choices=sorted(REWARDS), default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    global COST_S
    COST_S = args.cost_ms / 1000
    os.environ["PIPELINE_REWARDS"] = "cpu=__main__:busy,sleep=__main__:sleepy"
    times: dict[str, list[float]] = {"gen": [], "ours": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        output = f"file://{tmp}/shards"
        rewarder = mp.get_context("fork").Process(target=reward_loop, args=(server.url, COST_S), daemon=True)
        rewarder.start()
        try:
            for repeat in range(args.repeats):
                for mode in times:
                    times[mode].append(one_run(conn, output, f"{mode}-{repeat}", args, mode))
        finally:
            rewarder.terminate()
            rewarder.join(timeout=10)
    ours, base = (statistics.median(times[m]) for m in ("ours", "baseline"))
    ratios = {m: [t / g for t, g in zip(times[m], times["gen"], strict=True)] for m in ("ours", "baseline")}

    def spread(mode: str) -> str:
        values = times[mode]
        text = f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"
        if mode in ratios:
            r = ratios[mode]
            text += f" = {statistics.median(r):.3f}x generation (per repeat {min(r):.3f}-{max(r):.3f})"
        return text

    print(f"{args.requests} requests, jobs of {args.batch_size}, sim {args.capacity} slots at "
          f"{args.step_ms:g} ms/step, reward {args.cost_ms:g} ms/row ({args.kind}), medians of {args.repeats}")
    print(f"generation only {spread('gen')}")
    print(f"ours (rows + rewards ready) {spread('ours')}")
    print(f"rewards after generation in the trainer {spread('baseline')}")
    print(f"ours is {base / ours:.2f}x faster than the baseline")


if __name__ == "__main__":
    main()
