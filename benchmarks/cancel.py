"""Cancel of a 10 000-request run: wall time of `client.cancel(run)` on a real redis-server.

Each repeat submits a run of 10 000 requests (jobs of `--batch-size`) to a queue that also holds
another run's jobs, and times the cancel (every queued job removed with its staged prompt ids,
the wake-up published). Baseline in the same process: RQ's own per-job `Job.cancel()` on the
same jobs plus deleting their prompt ids, the way one would cancel without this feature.
Goal: < 1 s.

Second figure: how soon the engine is free. A `RolloutWorker` on the sim engine (10 ms decode
steps) holds 4 jobs of long sequences; the time from `cancel` to the engine holding no sequence,
in decode steps (median of the repeats). Goal: within one step of the worker seeing it.

    .venv/bin/python benchmarks/cancel.py [--requests 10000] [--batch-size 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import keys
from pipeline.core.broker.redis_server import RedisServer
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker


def requests(prefix: str, count: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 64}}
            for i in range(count)]


def ours(client: pipeline.Client, run: str) -> float:
    start = time.perf_counter()
    client.cancel(run)
    return time.perf_counter() - start


def baseline(conn: redis.Redis, job_ids: list[str]) -> float:
    start = time.perf_counter()
    for job_id in job_ids:
        Job.fetch(job_id, connection=conn, serializer=JSONSerializer).cancel()
        conn.delete(keys.prompts(job_id))
    return time.perf_counter() - start


def engine_free_s(conn: redis.Redis, output: str, run: str, step_s: float) -> float:
    """Seconds from `cancel(run)` to the engine holding none of the run's sequences."""
    client = pipeline.Client(conn)
    client.submit(requests(run, 8), run=run, output=output, batch_size=2)
    sim = SimEngine(SimConfig(capacity=64, step_s=step_s, median_tokens=10_000_000, p99_tokens=10_000_001))
    took: list[float] = []

    def driver() -> None:
        while sim.load() < 8:
            time.sleep(0.001)
        started = time.perf_counter()
        client.cancel(run)
        while sim.load():
            time.sleep(0.0002)
        took.append(time.perf_counter() - started)

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        RolloutWorker(conn, sim).work(burst=False, max_idle_time=1, with_scheduler=False, logging_level="ERROR")
    finally:
        thread.join()
        sim.close()
    return took[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        client = pipeline.Client(conn)
        output = f"file://{tmp}/shards"
        client.submit(requests("keep", 1000), run="kept", output=output, batch_size=args.batch_size)
        times, base = [], []
        for repeat in range(args.repeats):
            batch = client.submit(requests("c", args.requests), run=f"ours-{repeat}", output=output,
                                  batch_size=args.batch_size)
            times.append(ours(client, batch.run))
            assert set(batch.job_states().values()) == {"canceled"}
            other = client.submit(requests("c", args.requests), run=f"base-{repeat}", output=output,
                                  batch_size=args.batch_size)
            base.append(baseline(conn, other.job_ids))
        step_s = 0.01
        client.cancel("kept")  # the engine holds only the measured run's sequences
        free = [engine_free_s(conn, output, f"free-{r}", step_s) for r in range(args.repeats)]
        jobs = -(-args.requests // args.batch_size)
        o, b = statistics.median(times) * 1000, statistics.median(base) * 1000
        print(f"cancel of a {args.requests}-request run ({jobs} jobs of {args.batch_size}), median of "
              f"{args.repeats}: {o:.1f} ms; RQ per-job Job.cancel() baseline {b:.1f} ms; ratio {b / o:.1f}x faster")
        f = statistics.median(free)
        print(f"engine free after a cancel of jobs in flight: {f * 1000:.1f} ms = {f / step_s:.2f} decode steps of "
              f"{step_s * 1000:g} ms (median of {args.repeats}; max {max(free) / step_s:.2f} steps)")


if __name__ == "__main__":
    main()
