"""Sessions at fleet scale: what session affinity saves, how it holds load, and what a killed worker costs.

    .venv/bin/python benchmarks/affinity.py [--workers 4] [--sessions 512] [--turns 8] [--repeats 3]

Everything real but the model: a `redis-server`, `pipeline serve` (its own process, one per
placement), `pipeline worker --engine sim` processes, and agents as asyncio tasks over aiohttp.
The sim pays for prefill as an engine does (`workers.engines.sim.engine`: a per-engine LRU prefix cache
over 16-token blocks; the uncached context is computed at 50 000 tokens/s while the engine
decodes nothing; a weight swap empties the cache). Each session: a system prompt all sessions
share (200 tokens), a task of its own (50 tokens), then `--turns` turns, each answered (lengths
lognormal, median 40 tokens) and followed by a tool result of 200-400 tokens; the agent replays
its whole history, so turn k's prompt extends turn k-1's prompt and answer.

Placements, in the same run, alternating, `--repeats` times each:
- affinity: `pipeline serve` (a session's turns go to its home worker, bounded load 1.25);
- random: `pipeline serve --no-affinity` (each turn taken by whichever worker is free: the
  placement without affinity);
- sticky: affinity with no bound (`--load-factor 1e9`): a session never leaves its worker
  while it lives (the skewed mix shows why the bound is there).

Figures (from the rows: `prompt_tokens - cached_tokens` is the prefill a turn cost):
- prefill tokens computed, affinity against random: the ratio (goal >= 3x fewer);
- share of turns (after a session's first) served where its previous turn ran (goal >= 95 %);
- per-worker turns, max over mean, with a skewed mix (a few long sessions, many short; goal <= 1.5);
- a worker SIGKILLed mid-run: turns lost and duplicated (goal 0 and 0), and the turns it moved;
- turn latency p99 with a 10 000-request batch run in the same pool against idle (goal <= 2x).
All figures are the sim's (no model runs); the prefix-cache arithmetic is the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, percentile  # noqa: E402
from pipeline.core.broker import keys, registry  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.core.jobs.turn_queue import parse_turn_job  # noqa: E402

PIPELINE = [sys.executable, "-m", "pipeline.cli.main"]
SYSTEM = list(range(1000, 1200))  # the system prompt every session shares
SIM = ["--sim-step-ms", "2", "--sim-median-tokens", "40", "--sim-p99-tokens", "200", "--sim-capacity", "256",
       "--heartbeat-interval", "0.5", "--log-level", "WARNING"]
# Each engine's prefix cache: 524 288 tokens. Llama-3-8B's KV cache takes 128 KiB a token (32 layers,
# 8 KV heads of 128, K and V in bf16), so this is 64 GiB: what an 80 GB GPU keeps for KV beside that
# model's 16 GB of weights. Here it holds an engine's share of the sessions' histories (a quarter of
# about 1.5 M tokens), not all of them. `--cache-tokens` sets another: the figures depend on it
# (benchmarks/README.md gives 262 144 and 1 048 576 too).
CACHE_TOKENS = 524_288




class Fleet:
    """The redis-server's workers and servers, as processes."""

    def __init__(self, url: str, tmp: str, cache_tokens: int = CACHE_TOKENS) -> None:
        self.url = url
        self.cache_tokens = cache_tokens
        self.tmp = tmp
        self.env = {**os.environ, "PIPELINE_REDIS_URL": url, "PIPELINE_OUTPUT": f"file://{tmp}/shards",
                    "PIPELINE_STATE_DIR": f"{tmp}/state"}
        self.workers: list[subprocess.Popen] = []
        self.servers: dict[str, tuple[subprocess.Popen, str]] = {}

    def start_worker(self) -> subprocess.Popen:
        log = open(f"{self.tmp}/worker{len(self.workers)}.log", "w")  # noqa: SIM115
        process = subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", *SIM, "--sim-prefix-cache-tokens",
                                    str(self.cache_tokens)], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.workers.append(process)
        return process

    def server(self, name: str, *args: str) -> str:
        if name not in self.servers:
            port = free_port()
            log = open(f"{self.tmp}/serve-{name}.log", "w")  # noqa: SIM115
            process = subprocess.Popen([*PIPELINE, "serve", "--port", str(port), "--turn-timeout", "300", *args],
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit(f"pipeline serve {name} did not come up: see {self.tmp}/serve-{name}.log")
                time.sleep(0.2)
            self.servers[name] = (process, url)
        return self.servers[name][1]

    def wait_live(self, conn: redis.Redis, count: int) -> None:
        deadline = time.monotonic() + 120
        while len(registry.live_workers(conn)) != count:
            if time.monotonic() > deadline:
                raise SystemExit(f"{count} workers did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        for process in [*self.workers, *(p for p, _ in self.servers.values())]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.workers, *(p for p, _ in self.servers.values())]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


async def _session(client: aiohttp.ClientSession, url: str, run: str, turns: int, seed: int,
                   latencies: list[float]) -> None:
    rng = random.Random(seed)
    async with client.post(f"{url}/sessions", json={"run": run}) as created:
        sid = (await created.json())["session_id"]
    ids = SYSTEM + [rng.randrange(2000, 30000) for _ in range(50)]
    for turn in range(turns):
        started = time.perf_counter()
        body = {"model": "m", "prompt": ids, "max_tokens": 256}
        async with client.post(f"{url}/sessions/{sid}/v1/completions", json=body) as answer:
            got = await answer.json()
            if answer.status != 200:
                raise SystemExit(f"turn {turn} of session {sid}: HTTP {answer.status}: {got}; {_where(sid)}")
        latencies.append(time.perf_counter() - started)
        tool = [rng.randrange(2000, 30000) for _ in range(rng.randrange(200, 401))]
        ids = ids + got["choices"][0]["token_ids"] + tool


def _where(session_id: str) -> str:
    """Where a session's turn in flight is, for an error message."""
    import json

    conn = redis.Redis.from_url(os.environ["AFFINITY_REDIS"])
    pending = conn.hget(keys.session(session_id), "pending")
    if pending is None:
        return "no turn in flight"
    turn_id = json.loads(pending)["turn_id"]
    job_id, worker = parse_turn_job(conn.get(keys.turn_job(turn_id)))
    job_id = job_id or "?"
    found = [name.decode() for name in conn.scan_iter("*") if conn.type(name) == b"stream"
             and any(job_id.encode() in fields.get(b"job", b"") for _, fields in conn.xrange(name))]
    live = [w.worker_id for w in registry.live_workers(conn)]
    queues = sorted(m.decode() for m in conn.smembers(keys.pool(None).turn_queue_owners))
    return (f"job {job_id} (routed to {worker or 'the shared lane'}) in streams {found}; live workers {live}; "
            f"turn queues {queues}")


async def _agents(url: str, run: str, mix: list[int], seed: int) -> tuple[float, list[float]]:
    """One session per entry of `mix` (its number of turns), all at once."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=len(mix))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as client:
        started = time.perf_counter()
        await asyncio.gather(*(_session(client, url, run, turns, seed * 100_003 + i, latencies)
                               for i, turns in enumerate(mix)))
        return time.perf_counter() - started, latencies


def _rows(conn: redis.Redis, run: str) -> list[dict[str, Any]]:
    from pipeline.read.lineage_rows import turn_rows

    return turn_rows(run, conn).to_pylist()


def _moves(conn: redis.Redis) -> Counter[str]:
    """The pool's moves of session homes so far, by reason (`keys.PoolKeys.turn_stats`)."""
    stats = conn.hgetall(keys.pool(None).turn_stats)
    return Counter({k.decode()[6:]: int(v) for k, v in stats.items() if k.startswith(b"moves:")})


def _figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    by_session: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], {}).setdefault(row["turn"], []).append(row)
    homed = home = 0
    for turns in by_session.values():
        for turn, served in turns.items():
            if turn and turn - 1 in turns:
                homed += 1
                home += served[0]["worker_id"] == turns[turn - 1][0]["worker_id"]
    per_worker = Counter(r["worker_id"] for r in rows)
    mean = sum(per_worker.values()) / max(1, len(per_worker))
    return {
        "prefill": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
        "prompt": sum(r["prompt_tokens"] for r in rows),
        "home": home / max(1, homed),
        "imbalance": max(per_worker.values()) / mean if per_worker else 0.0,
        "turns": len(rows),
        "duplicated": sum(len(t) - 1 for turns in by_session.values() for t in turns.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=512)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=10_000, help="requests of the batch run (0: skip that figure)")
    parser.add_argument("--cache-tokens", type=int, default=CACHE_TOKENS, help="each engine's prefix cache, in tokens")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: skewed, kill")
    args = parser.parse_args()
    placements = {"affinity": (), "random": ("--no-affinity",), "sticky": ("--load-factor", "1e9")}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as redis_server:
        conn = redis.Redis.from_url(redis_server.url)
        os.environ["AFFINITY_REDIS"] = redis_server.url
        fleet = Fleet(redis_server.url, tmp, args.cache_tokens)
        try:
            for _ in range(args.workers):
                fleet.start_worker()
            fleet.wait_live(conn, args.workers)
            urls = {name: fleet.server(name, *flags) for name, flags in placements.items()}
            asyncio.run(_agents(urls["affinity"], "warmup", [2] * 8, 0))
            mix = [args.turns] * args.sessions
            print(f"{args.workers} sim workers (prefix cache {args.cache_tokens:,} tokens each, prefill 50 000 "
                  f"tokens/s), {args.sessions} sessions x {args.turns} turns at once, {args.repeats} repeats per "
                  "placement (figures are the sim's)", flush=True)

            results: dict[str, list[dict[str, float]]] = {"affinity": [], "random": []}
            for repeat in range(args.repeats):
                for name in (("affinity", "random") if repeat % 2 == 0 else ("random", "affinity")):
                    run = f"{name}-{repeat}"
                    before = _moves(conn)
                    seconds, latencies = asyncio.run(_agents(urls[name], run, mix, repeat + 1))
                    moves = _moves(conn) - before
                    figures = _figures(_rows(conn, run))
                    figures.update(seconds=seconds, p50=percentile(latencies, 0.5), p99=percentile(latencies, 0.99))
                    results[name].append(figures)
                    print(f"  {run}: {figures['turns']} turns in {seconds:.1f} s, prefill {figures['prefill']:,} of "
                          f"{figures['prompt']:,} prompt tokens, home {figures['home']:.1%}, max/mean worker turns "
                          f"{figures['imbalance']:.2f}, p50 {figures['p50'] * 1000:.0f} ms p99 "
                          f"{figures['p99'] * 1000:.0f} ms; moves {dict(moves) or 'none'}", flush=True)

            def median(name: str, key: str) -> float:
                return statistics.median(r[key] for r in results[name])

            ratios = [r["prefill"] / a["prefill"] for a, r in zip(results["affinity"], results["random"], strict=True)]
            print(f"prefill tokens computed: affinity {median('affinity', 'prefill'):,.0f}, random "
                  f"{median('random', 'prefill'):,.0f}: {statistics.median(ratios):.1f}x fewer with affinity "
                  f"(min {min(ratios):.1f}x, max {max(ratios):.1f}x; goal >= 3x)")
            homes = [r["home"] for r in results["affinity"]]
            print(f"turns on their home worker: affinity median {statistics.median(homes):.1%} (min {min(homes):.1%}; "
                  f"goal >= 95 %), random {median('random', 'home'):.1%}")
            print(f"turn latency: affinity p50 {median('affinity', 'p50') * 1000:.0f} ms p99 "
                  f"{median('affinity', 'p99') * 1000:.0f} ms; random p50 {median('random', 'p50') * 1000:.0f} ms "
                  f"p99 {median('random', 'p99') * 1000:.0f} ms; wall time affinity "
                  f"{median('affinity', 'seconds'):.1f} s, random {median('random', 'seconds'):.1f} s")

            skip = set(filter(None, args.skip.split(",")))
            if "skewed" not in skip:
                _skewed(conn, urls, args)
            if "kill" not in skip:
                _killed(conn, fleet, urls["affinity"], mix, args)
            if args.batch:
                _batch_figure(conn, urls["affinity"], args)
        finally:
            fleet.stop()


def _skewed(conn: redis.Redis, urls: dict[str, str], args: argparse.Namespace) -> None:
    """A few long sessions among many short ones: per-worker turns, max over mean, per placement."""
    long_turns = args.turns * 8
    skewed = [long_turns] * max(1, args.workers * 2) + [2] * args.sessions
    random.Random(5).shuffle(skewed)
    for name in ("affinity", "sticky", "random"):
        run = f"skewed-{name}"
        seconds, _ = asyncio.run(_agents(urls[name], run, skewed, 99))
        figures = _figures(_rows(conn, run))
        print(f"skewed mix ({skewed.count(long_turns)} sessions of {long_turns} turns, {args.sessions} of 2), "
              f"{name}: max/mean worker turns {figures['imbalance']:.2f} (goal <= 1.5 with affinity), "
              f"home {figures['home']:.1%}, prefill {figures['prefill']:,}, {seconds:.1f} s", flush=True)


def _killed(conn: redis.Redis, fleet: Fleet, url: str, mix: list[int], args: argparse.Namespace) -> None:
    """A worker SIGKILLed a third of the way into a run: turns lost, duplicated, moved; then replaced."""
    run = "killed"
    total = sum(mix)
    victim = fleet.workers[0]

    async def with_kill() -> tuple[float, list[float]]:
        task = asyncio.create_task(_agents(url, run, mix, 77))
        while int(conn.hget(keys.run_turn_stats(run), "turns") or 0) < total // 3:
            await asyncio.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        return await task

    moved_before = _moves(conn)["gone"]
    _, latencies = asyncio.run(with_kill())
    figures = _figures(_rows(conn, run))
    print(f"a worker SIGKILLed a third of the way through {total} turns: {figures['turns']} turns answered "
          f"({total - figures['turns']} lost), {figures['duplicated']} duplicated, "
          f"{_moves(conn)['gone'] - moved_before} turns moved off it, turn p99 {percentile(latencies, 0.99):.1f} s, "
          f"max {max(latencies):.1f} s", flush=True)
    fleet.workers.remove(victim)
    fleet.start_worker()
    fleet.wait_live(conn, args.workers)


def _batch_figure(conn: redis.Redis, url: str, args: argparse.Namespace) -> None:
    """Turn latency p99 of a smaller session set, idle against with a batch run filling the pool
    (each batch request 1 000 tokens, EOS ignored: a sequence holds its slot about 2 s)."""
    import pipeline
    from schemas.request import RolloutRequest

    mix = [args.turns] * max(8, args.sessions // 8)
    _, idle = asyncio.run(_agents(url, "lane-idle", mix, 11))
    client = pipeline.Client(conn)
    requests = [RolloutRequest.model_validate({"id": f"b{i}", "input_ids": list(range(1, 65)),
                                               "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}})
                for i in range(args.batch)]
    batch = client.submit(requests, run="lane-batch")
    deadline = time.monotonic() + 120
    while batch.status().counts.get("started", 0) < args.workers and time.monotonic() < deadline:
        time.sleep(0.2)  # every worker is generating the batch
    _, busy = asyncio.run(_agents(url, "lane-busy", mix, 11))
    during = batch.status()
    p99_busy, p99_idle = percentile(busy, 0.99), percentile(idle, 0.99)
    print(f"turn latency with a {args.batch}-request batch run in the pool (its jobs when the sessions ended: "
          f"{dict(during.counts)}): p99 {p99_busy * 1000:.0f} ms against {p99_idle * 1000:.0f} ms "
          f"idle: {p99_busy / p99_idle:.2f}x (goal <= 2x); p50 {percentile(busy, 0.5) * 1000:.0f} ms "
          f"against {percentile(idle, 0.5) * 1000:.0f} ms", flush=True)
    try:
        batch.cancel()
    except redis.RedisError as exc:  # an overloaded machine: the run is left to finish
        print(f"(could not cancel the batch run: {exc})")

if __name__ == "__main__":
    main()
