"""Redis on another host: a lone agent turn, `pipeline submit` and a batch job at 0, 0.5 and 2 ms
round trip to Redis, and the Redis round trips each takes.

    .venv/bin/python benchmarks/across_hosts.py [--rtts 0,0.5,2] [--sessions 4] [--turns 8] [--repeats 3]
                                                [--requests 2000] [--jobs 20] [--idle-s 10]

A `redis-server` on a loopback port (AOF, appendfsync everysec), and between it and each client a
delay proxy (benchmarks/delay_proxy.py: user-space, the kernel here has no `tc netem`) holding
every chunk RTT/2 each way: one for `pipeline serve` (its own process), one for the sim worker
(its own process: the sim at infinite speed, 8-token replies, as in benchmarks/serve.py), one for
the submitting client (this process). All three go through their proxy at every RTT, 0 included,
so the proxy's own hop (about 0.1 ms) is in every figure and cancels out of the differences.

- lone turn: `--sessions` sessions one after the other, `--turns` chat turns each, through
  `pipeline serve`; per RTT the median turn and its spread (p10-p90) over every turn of
  `--repeats` rounds (the RTTs alternate round by round, on the same processes), the added latency
  over the sim engine called alone in this process (the baseline, same run), and the increase over
  0 ms. The increase / RTT is the number of round trips on a turn's critical path.
- submit: `submit_file` of `--requests` requests (batches of 64) into a database no worker reads,
  per RTT and round; the median requests/s and spread.
- round trips, counted by the proxies at 0 ms: an exchange is a client write that follows an
  answer from Redis on the same connection (commands sent together, a pipeline, MULTI/EXEC or a
  script, are one; a command sent after waiting on the previous one's answer is one more). Per
  turn: the exchanges the serve side and the worker side made over every turn of a lone run, less
  their idle rate (heartbeats, blocking reads timing out) measured for `--idle-s` just before.
  Per batch job: the worker side's over `--jobs` jobs of 8 requests. Per submit: the client's.
  Exchanges on different connections of a process may overlap, so these are upper bounds on the
  sequential round trips; the critical-path figure above is the one a turn's latency pays.

The engine is the sim's, not a model: these are the pipeline's own costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import serve as serve_bench  # noqa: E402
from benchmarks.common import free_port, percentile, stop_processes, wait_for_serve  # noqa: E402
from benchmarks.delay_proxy import DelayProxy  # noqa: E402
from pipeline.core.broker import commit_log  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402

RUN = "hosts"


def _worker(url: str) -> None:
    os.environ["PIPELINE_REDIS_URL"] = url
    serve_bench._worker(url)


def _server(url: str, port: int, output: str) -> None:
    os.environ["PIPELINE_REDIS_URL"] = url
    serve_bench._server(url, port, output, RUN)


def _lone(url: str, sessions: int, turns: int) -> list[float]:
    """Each turn's latency, `sessions` sessions of `turns` turns one after the other."""
    return asyncio.run(serve_bench._load(url, sessions, turns, 1, "chat"))[1]


def _requests(path: Path, count: int, prefix: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "input_ids": list(range(1, 65)),
                                        "sampling_params": {"max_new_tokens": 8}}) + "\n" for i in range(count)))
    return path


def _submit_s(url: str, path: Path) -> float:
    from pipeline.submit.enqueue import submit_file

    conn = redis.Redis.from_url(url)
    started = time.perf_counter()
    submit_file(conn, path, run="submit-bench", output="memory://bench", batch_size=64)
    seconds = time.perf_counter() - started
    conn.flushdb()
    conn.close()
    return seconds


def _spread(values: list[float], scale: float = 1000) -> str:
    return (f"median {statistics.median(values) * scale:.2f} (p10 {percentile(values, 0.1) * scale:.2f}, "
            f"p90 {percentile(values, 0.9) * scale:.2f})")


def _counted(proxies: list[DelayProxy], idle_s: float, work: object) -> list[float]:
    """Exchanges each proxy carried while `work()` ran, less its idle rate over `idle_s` before."""
    before = [p.exchanges for p in proxies]
    time.sleep(idle_s)
    idle = [(p.exchanges - b) / idle_s for p, b in zip(proxies, before, strict=True)]
    before = [p.exchanges for p in proxies]
    started = time.monotonic()
    work()  # type: ignore[operator]
    seconds = time.monotonic() - started
    return [p.exchanges - b - rate * seconds for p, b, rate in zip(proxies, before, idle, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", default="0,0.5,2", help="round trips to Redis, ms, comma-separated")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000, help="requests per submit (0: skip)")
    parser.add_argument("--jobs", type=int, default=20, help="batch jobs whose round trips are counted (0: skip)")
    parser.add_argument("--idle-s", type=float, default=10)
    args = parser.parse_args()
    rtts = [float(r) for r in args.rtts.split(",")]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=free_port()) as server:
        upstream = ("127.0.0.1", server.port)
        serve_proxy, worker_proxy, client_proxy = DelayProxy(upstream), DelayProxy(upstream), DelayProxy(upstream)
        proxies = [serve_proxy, worker_proxy, client_proxy]
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(worker_proxy.url(),), daemon=True),
                 ctx.Process(target=_server, args=(serve_proxy.url(), port, f"file://{tmp}/shards"), daemon=True)]
        for proc in procs:
            proc.start()
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_serve(url, 1)
            _lone(url, 2, 2)  # warm-up: imports, templates, connections
            print(f"sizes: {args.sessions} sessions x {args.turns} turns per RTT and round, {args.repeats} rounds; "
                  f"submit {args.requests} requests; {args.jobs} batch jobs of 8 requests")

            # Round trips, counted at 0 ms.
            turns = args.sessions * args.turns
            serve_x, worker_x, _ = _counted(proxies, args.idle_s, lambda: _lone(url, args.sessions, args.turns))
            print(f"round trips per turn (exchanges, idle rate subtracted, {turns} turns, session creation "
                  f"included): serve side {serve_x / turns:.1f}, worker side {worker_x / turns:.1f}")
            if args.jobs:
                conn = redis.Redis.from_url(client_proxy.url())
                path = _requests(Path(tmp) / "batch.jsonl", args.jobs * 8, "b")

                def batch() -> None:
                    from pipeline.submit.enqueue import submit_file

                    submit_file(conn, path, run="batch", output=f"file://{tmp}/shards", batch_size=8)
                    while len(commit_log.read_all(conn, "batch")) < args.jobs:
                        time.sleep(0.05)

                _, worker_x, client_x = _counted(proxies, args.idle_s, batch)
                print(f"round trips per batch job (exchanges, idle rate subtracted, {args.jobs} jobs of 8 requests): "
                      f"worker side {worker_x / args.jobs:.1f}; the submit of all {args.jobs}: {client_x:.0f} "
                      "(client side, its waiting on the commit log included)")

            direct = serve_bench._direct_latency(200)
            print(f"baseline: the sim engine called alone: {_spread(direct)} ms per turn")
            lone: dict[float, list[float]] = {r: [] for r in rtts}
            submits: dict[float, list[float]] = {r: [] for r in rtts}
            submit_path = _requests(Path(tmp) / "submit.jsonl", args.requests, "s")
            for _ in range(args.repeats):
                for rtt in rtts:
                    for proxy in proxies:
                        proxy.one_way_s = rtt / 2000
                    lone[rtt] += _lone(url, args.sessions, args.turns)
                    if args.requests:
                        submits[rtt].append(args.requests / _submit_s(client_proxy.url(1), submit_path))
            base = statistics.median(direct)
            zero = statistics.median(lone[rtts[0]])
            for rtt in rtts:
                turn = statistics.median(lone[rtt])
                line = (f"RTT {rtt:g} ms: lone turn {_spread(lone[rtt])} ms over {len(lone[rtt])} turns; added over "
                        f"the sim alone {(turn - base) * 1000:.2f} ms; over {rtts[0]:g} ms RTT "
                        f"{(turn - zero) * 1000:+.2f} ms")
                if rtt:
                    line += f" ({(turn - zero) * 1000 / rtt:.1f} round trips on the critical path)"
                if args.requests:
                    rates = submits[rtt]
                    line += (f"; submit {statistics.median(rates):.0f} requests/s (min {min(rates):.0f}, "
                             f"max {max(rates):.0f})")
                print(line, flush=True)
        finally:
            stop_processes(procs)
            for proxy in proxies:
                proxy.close()


if __name__ == "__main__":
    main()
