"""Control overhead of a weight push: time to all acknowledgements minus the engine's own load.

Starts 1, 4 and 8 real worker processes (each a `RolloutWorker` around the shipped fake engine whose
weight load takes a fixed, known time) on a real redis-server, pushes new versions and
measures `push_weights` wall time minus the slowest worker's reported load time. Baseline in
the same process: a bare pub/sub ping to the same worker processes answered through a Redis
hash (the least any wake-and-acknowledge protocol over Redis can cost). Goal: < 50 ms at 8.

    .venv/bin/python benchmarks/control_push.py [--pushes 15] [--load-ms 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from pipeline.core.broker import control_channel, registry
from pipeline.core.broker.redis_server import RedisServer
from workers.engines.fake import FakeEngine

PING_CHANNEL = "bench:ping"


def _ping_responder(url: str, worker_id: str) -> None:
    conn = redis.Redis.from_url(url)
    pubsub = conn.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(PING_CHANNEL)
    for message in pubsub.listen():
        conn.hset(f"bench:pong:{message['data'].decode()}", worker_id, "1")


def run_worker(url: str, load_s: float) -> None:
    from workers.process.worker import RolloutWorker

    worker_id = f"bench-{uuid.uuid4().hex[:6]}"
    threading.Thread(target=_ping_responder, args=(url, worker_id), daemon=True).start()
    worker = RolloutWorker(redis.Redis.from_url(url), FakeEngine(load_s=load_s), worker_id=worker_id)
    worker.work(burst=False, with_scheduler=False, logging_level="ERROR")


def ping_round_trip(conn: redis.Redis, workers: int) -> float:
    token = uuid.uuid4().hex
    start = time.perf_counter()
    conn.publish(PING_CHANNEL, token)
    while conn.hlen(f"bench:pong:{token}") < workers:
        time.sleep(0.0005)
    return time.perf_counter() - start


def measure(url: str, workers: int, pushes: int, load_s: float, first_version: int) -> tuple[list[float], list[float]]:
    conn = redis.Redis.from_url(url)
    procs = [mp.Process(target=run_worker, args=(url, load_s), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while len(registry.live_workers(conn)) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register")
            time.sleep(0.1)
        time.sleep(1.0)  # let every listener subscribe and settle
        overheads, pings = [], []
        for i in range(pushes):
            version = first_version + i
            start = time.perf_counter()
            result = control_channel.push_weights(conn, f"/weights/v{version}", version, timeout=60)
            elapsed = time.perf_counter() - start
            overheads.append(elapsed - max(ack.seconds for ack in result.acks))
            pings.append(ping_round_trip(conn, workers))
        return overheads, pings
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
        for info in registry.live_workers(conn):
            registry.remove(conn, info.worker_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pushes", type=int, default=15)
    parser.add_argument("--load-ms", type=float, default=20.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    mp.set_start_method("spawn")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        url = server.url
        version = 1
        print(f"{'workers':>7}  {'push overhead (median)':>22}  {'pub/sub ping (median)':>21}  ratio")
        for count in args.workers:
            overheads, pings = measure(url, count, args.pushes, args.load_ms / 1000, version)
            version += args.pushes
            o, p = statistics.median(overheads) * 1000, statistics.median(pings) * 1000
            print(f"{count:>7}  {o:>19.1f} ms  {p:>18.1f} ms  {o / p:5.1f}x")


if __name__ == "__main__":
    main()
