"""Cancel of a 10 000-request run: wall time of `client.cancel(run)` on a real redis-server.

Each repeat submits a run of 10 000 requests (jobs of `--batch-size`) to a queue that also holds
another run's jobs, and times the cancel (every queued job removed with its staged prompt ids,
the wake-up published). Baseline in the same process: RQ's own per-job `Job.cancel()` on the
same jobs plus deleting their prompt ids, the way one would cancel without this feature.
Goal: < 1 s.

    .venv/bin/python benchmarks/cancel.py [--requests 10000] [--batch-size 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline import keys
from pipeline.redis_server import RedisServer


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
        jobs = -(-args.requests // args.batch_size)
        o, b = statistics.median(times) * 1000, statistics.median(base) * 1000
        print(f"cancel of a {args.requests}-request run ({jobs} jobs of {args.batch_size}), median of "
              f"{args.repeats}: {o:.1f} ms; RQ per-job Job.cancel() baseline {b:.1f} ms; ratio {b / o:.1f}x faster")


if __name__ == "__main__":
    main()
