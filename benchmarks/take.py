"""`batch.take(groups=N)` with DAPO's filter at a 50 % drop rate: over-sampling against rounds.

A real redis-server, a `RolloutWorker` process on the sim engine and a `RewardWorker` process.
The reward function gives half of the prompts (by a hash of the request id) rewards that differ
within the group, the other half equal rewards, so `rewards_differ` drops about half the groups.

- ours: `submit(groups=N, oversample=F, reward=...)` and one `take(keep=rewards_differ)`, which
  cancels what remains once N groups are kept;
- baseline over-sampling by the same factor: submit ceil(N x F) prompts, wait for all of them,
  keep N of the survivors, and again for the missing number if fewer survived (a user without a
  take that cancels the rest once N are kept);
- baseline without over-sampling (the issue-17 figure): submit N prompts, take what survives,
  submit the missing number again, ... until N groups are kept (one round per submit).

Prints rounds, wall time, groups dropped, and the work canceled (jobs removed before they ran,
jobs aborted in flight, and an upper bound of the engine time spent on those: their samples x the
time since each job started, counting samples that waited in the engine as if they ran).

    .venv/bin/python benchmarks/take.py [--groups 32] [--oversample 2.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker.redis_server import RedisServer
from pipeline.runs.take import rewards_differ
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker
from workers.rewards.reward_worker import RewardWorker

SAMPLES = 4


def coin(rows: list[dict]) -> list[float]:
    """Rewards that differ within the group for half the prompts (by request id), equal for the rest."""
    return [float(row["sample_index"] % 2) if zlib.crc32(row["request_id"].encode()) % 2 else 1.0 for row in rows]


def rollout_loop(url: str, step_s: float) -> None:
    engine = SimEngine(SimConfig(capacity=64, step_s=step_s, median_tokens=100, p99_tokens=400, seed=2))
    RolloutWorker(redis.Redis.from_url(url), engine, control_poll_s=0.1).work(with_scheduler=False,
                                                                              logging_level="ERROR")


def reward_loop(url: str) -> None:
    RewardWorker(redis.Redis.from_url(url), block_ms=50).work()


def prompts(prefix: str, count: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1 + i % 1000] * 16,
             "sampling_params": {"max_new_tokens": 100_000, "n": SAMPLES, "seed": i}} for i in range(count)]


def lost_slot_seconds(conn: redis.Redis, job_ids: list[str], at: float) -> float:
    """Engine slot-seconds spent on the jobs a cancel at `at` aborted in flight: samples x (at - start)."""
    total = 0.0
    for job_id in job_ids:
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        if job.get_status() in {"started", "canceled"} and job.started_at is not None:
            total += SAMPLES * len(job.args[0]["requests"]) * max(0.0, at - job.started_at.timestamp())
    return total


def ours(client: pipeline.Client, run: str, groups: int, oversample: float, output: str) -> dict:
    started = time.perf_counter()
    batch = client.submit(prompts(run, 10 * groups), run=run, output=output, batch_size=4, reward="coin",
                          groups=groups, oversample=oversample)
    taken = batch.take(keep=rewards_differ, timeout=600)
    seconds = time.perf_counter() - started
    canceled = taken.canceled
    lost = lost_slot_seconds(client.conn, canceled.job_ids, time.time()) if canceled else 0.0
    return {"seconds": seconds, "rounds": 1, "kept": len(taken.groups), "dropped": len(taken.dropped),
            "canceled_queued": canceled.queued if canceled else 0,
            "canceled_running": canceled.running if canceled else 0, "lost_slot_s": lost}


def baseline(client: pipeline.Client, run: str, groups: int, output: str, oversample: float = 1.0) -> dict:
    """Rounds of submit, wait, filter until N groups are kept. `oversample=F`: each round submits
    ceil(missing x F) prompts and waits for all of them (what a user over-sampling without a take
    that cancels the rest would write); 1: the missing number."""
    started = time.perf_counter()
    kept, dropped, rounds = 0, 0, 0
    while kept < groups:
        want = groups - kept
        count = math.ceil(want * oversample - 1e-9)
        batch = client.submit(prompts(f"{run}-{rounds}-", count), run=run, output=output, batch_size=4,
                              reward="coin")
        # groups=count: a take that returns once every group is in (fewer than count survive the filter).
        taken = batch.take(groups=count if oversample > 1 else want, keep=rewards_differ, timeout=600,
                           cancel_rest=False)
        kept, dropped, rounds = kept + min(want, len(taken.groups)), dropped + len(taken.dropped), rounds + 1
    return {"seconds": time.perf_counter() - started, "rounds": rounds, "kept": kept, "dropped": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--oversample", type=float, default=2.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=2.0)
    args = parser.parse_args()
    os.environ["PIPELINE_REWARDS"] = "coin=__main__:coin"
    fork = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        client = pipeline.Client(redis.Redis.from_url(server.url))
        output = f"file://{tmp}/shards"
        procs = [fork.Process(target=rollout_loop, args=(server.url, args.step_ms / 1000), daemon=True),
                 fork.Process(target=reward_loop, args=(server.url,), daemon=True)]
        for proc in procs:
            proc.start()
        try:
            mine, over, base = [], [], []
            for r in range(args.repeats):  # interleaved, so a busy machine slows each alike
                mine.append(ours(client, f"ours{r}", args.groups, args.oversample, output))
                over.append(baseline(client, f"over{r}", args.groups, output, args.oversample))
                base.append(baseline(client, f"base{r}", args.groups, output))
        finally:
            for proc in procs:
                proc.terminate()
                proc.join(timeout=10)
    for name, runs in (("ours", mine), ("baseline over-sampling", over), ("baseline", base)):
        print(f"{name}: " + "; ".join(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in r.items()) for r in runs))

    def seconds(runs: list[dict]) -> str:
        values = [r["seconds"] for r in runs]
        return (f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}) in "
                f"{statistics.median(r['rounds'] for r in runs):g} round(s)")

    o = statistics.median(r["seconds"] for r in mine)
    print(f"N={args.groups} groups kept, oversample {args.oversample:g}, medians of {args.repeats}: "
          f"ours {seconds(mine)}")
    print(f"baseline over-sampling by {args.oversample:g} (submit, wait for all, filter; again if short): "
          f"{seconds(over)}; ratio {statistics.median(r['seconds'] for r in over) / o:.2f}x")
    print(f"baseline without over-sampling (submit the missing number each round): {seconds(base)}; ratio "
          f"{statistics.median(r['seconds'] for r in base) / o:.2f}x")


if __name__ == "__main__":
    main()
