"""Submit throughput: requests/s from a JSONL of 512-token prompts into Redis, validated.

Ours: `pipeline.intake.submit.submit_file`, what `pipeline submit` runs: lines parsed by simdjson in
blocks (prompt ids straight into arrays; the other fields checked as the strict model would,
each distinct sampling_params shape validated once by pydantic; anything unusual through the
full pydantic parse), each job packed as soon as it fills and its prompt ids (raw bytes beside
the job) staged to Redis from a background thread while parsing goes on, then one MULTI/EXEC
enqueuing every job. Baseline (same process, same Redis): one RQ `Queue.enqueue` per request
with the request line as its JSON argument, unvalidated. Prints medians over repeats, the
ratio, and Redis memory per token.

    .venv/bin/python benchmarks/submit.py [--requests 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.broker.redis_server import RedisServer
from pipeline.intake.submit import submit_file


def make_file(path: Path, count: int, prompt_len: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as handle:
        for i in range(count):
            line = {"id": f"q{i}", "input_ids": [rng.randrange(150_000) for _ in range(prompt_len)],
                    "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "n": 4, "seed": i},
                    "metadata": {"group": i}}
            handle.write(json.dumps(line) + "\n")


def bench_pipeline(conn: redis.Redis, path: Path) -> float:
    conn.flushall()
    start = time.perf_counter()
    plan = submit_file(conn, path, run="bench", output="memory://bench", batch_size=64)
    return plan.requests / (time.perf_counter() - start)


def bench_baseline(conn: redis.Redis, path: Path) -> float:
    conn.flushall()
    queue = Queue("baseline", connection=conn, serializer=JSONSerializer)
    start = time.perf_counter()
    count = 0
    with open(path) as handle:
        for line in handle:
            queue.enqueue("workers.jobs.batch_job.run_rollout_batch", json.loads(line), description="x")
            count += 1
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        path = Path(tmp) / "rollouts.jsonl"
        make_file(path, args.requests, args.prompt_len)
        ours = [bench_pipeline(conn, path) for _ in range(args.repeats)]
        info = conn.info("memory")
        tokens = args.requests * args.prompt_len
        per_token = info["used_memory"] / tokens
        base = [bench_baseline(conn, path) for _ in range(args.repeats)]
    ours_m, base_m = statistics.median(ours), statistics.median(base)
    print(f"submit: {ours_m:,.0f} requests/s (median of {args.repeats}; {args.requests} x {args.prompt_len}-token "
          f"prompts, validated, batch 64)")
    print(f"baseline one enqueue per request: {base_m:,.0f} requests/s")
    print(f"ratio: {ours_m / base_m:.1f}x")
    print(f"Redis memory per queued prompt token: {per_token:.2f} bytes (used_memory after submit / tokens)")


if __name__ == "__main__":
    main()
