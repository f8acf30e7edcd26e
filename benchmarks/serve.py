"""The agent endpoint under load: turns/s through `pipeline serve`, the latency it adds per turn, and
how many shards a run of turns leaves.

    .venv/bin/python benchmarks/serve.py [--sessions 256] [--turns 8] [--workers 1] [--repeats 3]

Everything real but the model: a `redis-server` set up as the embedded default is (unix socket, AOF,
`$PIPELINE_REDIS_APPENDFSYNC`, default everysec), `pipeline serve` (uvicorn, its own process),
`pipeline worker` processes (each its own process) around a zero-time engine (the sim at
infinite speed: continuous batching whose steps take no time, 8 tokens a reply), and agents
as asyncio tasks over one aiohttp client, each a session of chat turns whose messages grow as
an agent's do (every turn replays the history plus the assistant's answer and a new user
message: the prefix rule extends the prompt ids).

- throughput: `--sessions` concurrent sessions of `--turns` turns each, `--repeats` times: the
  median turns/s and its spread;
- added latency: one session alone, turn after turn, against the same engine called directly
  (`engine.generate` on the same request, in this process) in the same run: p50 and p99 of
  (turn latency - direct call), what the pipeline adds (HTTP, rendering, Redis, the queue, the
  worker, the commit, the answer);
- Redis work: commands per turn (Redis's own `INFO commandstats`, commands run inside scripts
  included) for the lone session and under load, and commands per second of each idle worker,
  measured before the server starts (`--workers` of them: a pool's periodic cleanup is done once
  per interval by one of them, so the figure per worker falls as the pool grows);
- fsync: the lone session again with the embedded default's `appendfsync everysec` and with
  `always` (the old default), switched on the same server (`CONFIG SET`), same run;
- shards: a run of 10 000 turns (sessions of `--turns`, `--sessions` at a time), then the number
  of shard files it left (turn rows are written many to a shard) and turns per shard.

The engine is the sim's, not a model: these are the pipeline's own costs; a real engine adds its
prefill and decode time. Prints medians, spreads and ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, percentile, stop_processes, wait_for_serve  # noqa: E402
from pipeline.core import settings  # noqa: E402
from pipeline.core.broker import commit_log, keys  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402

TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "tiny-tools"
REPLY_TOKENS = 8



def _engine() -> Any:
    """The sim at infinite speed: a continuous-batching engine whose steps take no time, answering
    8 tokens of the tokenizer's vocabulary."""
    from transformers import AutoTokenizer

    from workers.engines.sim.engine import SimConfig, SimEngine

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    return SimEngine(SimConfig(median_tokens=REPLY_TOKENS, p99_tokens=REPLY_TOKENS, vocab_size=len(tokenizer),
                               eos_token_id=tokenizer.eos_token_id))


def _worker(url: str) -> None:
    from workers.process.worker import RolloutWorker

    conn = redis.Redis.from_url(url)
    RolloutWorker(conn, _engine()).work(burst=False, with_scheduler=False, logging_level="WARNING")


def _server(url: str, port: int, output: str, run: str) -> None:
    from pipeline.serve.server import ServeConfig, Server

    config = ServeConfig(port=port, redis_url=url, tokenizer=str(TOKENIZER), run=run, output=output,
                         turn_timeout_s=120)
    Server(config).run()


class Agent:
    """One session, one turn at a time; its history grows as an agent's does (every turn replays the
    history plus the assistant's answer and a new user message; `tokens`: the last prompt's ids plus the
    sampled ids and a tool result)."""

    def __init__(self, client: aiohttp.ClientSession, url: str, mode: str) -> None:
        self.client, self.url, self.mode = client, url, mode
        self.messages: list[dict[str, str]] = [{"role": "user", "content": "Tell me something."}]
        self.ids = list(range(10, 60))
        self.sid = ""
        self.turns = 0

    async def open(self) -> None:
        async with self.client.post(f"{self.url}/sessions", json={}) as created:
            self.sid = (await created.json())["session_id"]

    async def turn(self) -> None:
        if self.mode == "chat":
            route, body = "chat/completions", {"model": "m", "messages": self.messages, "max_tokens": 16}
        else:
            route, body = "completions", {"model": "m", "prompt": self.ids, "max_tokens": 16}
        async with self.client.post(f"{self.url}/sessions/{self.sid}/v1/{route}", json=body) as answer:
            got = await answer.json()
            if answer.status != 200:
                raise SystemExit(f"turn {self.turns + 1} of session {self.sid}: HTTP {answer.status}: {got}")
        choice = got["choices"][0]
        if self.mode == "chat":
            self.messages += [{"role": "assistant", "content": choice["message"]["content"]},
                              {"role": "user", "content": f"And more ({self.turns})."}]
        else:  # the next prompt extends the last one with the sampled ids and a tool result
            self.ids = self.ids + choice["token_ids"] + [11, 12, 13]
        self.turns += 1


async def _session(client: aiohttp.ClientSession, url: str, turns: int, latencies: list[float], mode: str) -> None:
    agent = Agent(client, url, mode)
    await agent.open()
    for _ in range(turns):
        started = time.perf_counter()
        await agent.turn()
        latencies.append(time.perf_counter() - started)


async def _load(url: str, sessions: int, turns: int, concurrency: int, mode: str) -> tuple[float, list[float]]:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                await _session(client, url, turns, latencies, mode)

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sessions)))
        return time.perf_counter() - started, latencies


def _direct_latency(samples: int) -> list[float]:
    """The same engine called directly on a turn's request, in this process."""
    from schemas.request import RolloutRequest

    engine = _engine()
    request = RolloutRequest.model_validate({"id": "s:0", "input_ids": list(range(1, 40)), "logprobs": 0,
                                             "sampling_params": {"max_new_tokens": 16}})
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        engine.generate([request])
        out.append(time.perf_counter() - started)
    return out


def _command_counts(conn: redis.Redis) -> dict[str, int]:
    """Commands Redis has run since its last `CONFIG RESETSTAT` by name, bar the benchmark's own INFO/CONFIG."""
    return {name.removeprefix("cmdstat_"): stat["calls"] for name, stat in conn.info("commandstats").items()
            if name not in ("cmdstat_info", "cmdstat_config")}


def _commands(conn: redis.Redis) -> int:
    return sum(_command_counts(conn).values())


def _profile(counts: dict[str, int], turns: int) -> str:
    """The commands per turn by name, most first (commands run inside scripts counted as theirs)."""
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {calls / turns:.1f}" for name, calls in ranked if calls / turns >= 0.5)


def _redis_cpu_s(conn: redis.Redis) -> float:
    """CPU seconds the Redis server has used (user + system, its own counters)."""
    info = conn.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _lone_turns(url: str, turns: int, mode: str) -> list[float]:
    """Added latency per turn of one session alone (8 sessions one after the other), against the
    engine called directly in this process."""
    _, alone = asyncio.run(_load(url, 8, turns, 1, mode))
    direct = _direct_latency(len(alone))
    return [a - d for a, d in zip(sorted(alone), sorted(direct), strict=True)]


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-turns", type=int, default=10_000, help="turns of the shard-count run (0: skip)")
    parser.add_argument("--mode", choices=["chat", "tokens"], default="chat",
                        help="chat: /v1/chat/completions, rendered by the chat template; tokens: /v1/completions "
                             "with token ids (the same road without the template)")
    parser.add_argument("--idle-s", type=float, default=30, help="seconds the idle workers are measured (0: skip)")
    parser.add_argument("--fsync-ab", type=int, default=3,
                        help="alternating rounds of the lone session with appendfsync everysec and always (0: skip)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0,
                                                           appendfsync=settings.redis_appendfsync()) as redis_server:
        conn = redis.Redis.from_url(redis_server.url)
        port = free_port()
        output = f"file://{tmp}/shards"
        run = "bench"
        housekeeping = 0.0
        if args.idle_s:  # the server's own CPU with no client, subtracted from the idle workers'
            before = _redis_cpu_s(conn)
            time.sleep(args.idle_s / 4)
            housekeeping = (_redis_cpu_s(conn) - before) / (args.idle_s / 4)
        procs = [ctx.Process(target=_worker, args=(redis_server.url,), daemon=True) for _ in range(args.workers)]
        for proc in procs:
            proc.start()
        if args.idle_s:  # the workers alone, idle, once they have joined and settled
            deadline = time.monotonic() + 120
            while conn.scard(keys.pool(None).workers) < args.workers and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(15)
            conn.config_resetstat()
            before = _redis_cpu_s(conn)
            time.sleep(args.idle_s)
            idle = _commands(conn) / args.idle_s
            cpu_us = ((_redis_cpu_s(conn) - before) / args.idle_s - housekeeping) / args.workers * 1e6
            print(f"idle: {args.workers} worker(s), {idle / args.workers:.2f} Redis commands/s and {cpu_us:.0f} µs of "
                  f"Redis CPU a second per worker over {args.idle_s:g} s (the server's own {housekeeping * 1e6:.0f} "
                  f"µs/s subtracted; goal: at most 3 commands/s per worker)", flush=True)
        procs.append(ctx.Process(target=_server, args=(redis_server.url, port, output, run), daemon=True))
        procs[-1].start()
        print(f"processes: server {procs[-1].pid}, workers {[p.pid for p in procs[:-1]]}", flush=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_serve(url, args.workers)
            asyncio.run(_load(url, 4, 2, 4, args.mode))  # warm-up: imports, templates, connections

            # Added latency: one session alone, against the engine called directly in this run; with
            # the server's fsync policy, then each policy in turn on the same server (same run).
            policy = conn.config_get("appendfsync")["appendfsync"]
            conn.config_resetstat()
            added = _lone_turns(url, args.turns, args.mode)
            lone = _command_counts(conn)
            lone_commands = sum(lone.values()) / len(added)
            print(f"added latency per turn ({args.mode}), one session alone ({len(added)} turns, appendfsync "
                  f"{policy}): p50 {percentile(added, 0.5) * 1000:.2f} ms, "
                  f"p99 {percentile(added, 0.99) * 1000:.2f} ms; "
                  f"{lone_commands:.1f} Redis commands per turn")
            print(f"  by command: {_profile(lone, len(added))}")
            if args.fsync_ab:
                medians: dict[str, list[float]] = {"everysec": [], "always": []}
                for _ in range(args.fsync_ab):
                    for name in medians:
                        conn.config_set("appendfsync", name)
                        medians[name].append(percentile(_lone_turns(url, args.turns, args.mode), 0.5))
                conn.config_set("appendfsync", policy)
                every, always = (statistics.median(medians[n]) for n in ("everysec", "always"))
                print(f"fsync, {args.fsync_ab} alternating rounds of the lone session, medians of the rounds' p50: "
                      f"everysec {every * 1000:.2f} ms (min {min(medians['everysec']) * 1000:.2f}, max "
                      f"{max(medians['everysec']) * 1000:.2f}), always {always * 1000:.2f} ms (min "
                      f"{min(medians['always']) * 1000:.2f}, max {max(medians['always']) * 1000:.2f}): "
                      f"always / everysec {always / every:.2f}x")

            rates, p50s, p99s = [], [], []
            redis_pid = int((redis_server.directory / "redis.pid").read_text())
            pids = {"server": procs[-1].pid, "workers": [p.pid for p in procs[:-1]], "redis": redis_pid,
                    "agents": os.getpid()}
            cpu_before = {name: sum(_cpu_s(p) for p in (ids if isinstance(ids, list) else [ids]))
                          for name, ids in pids.items()}
            turns_done = 0
            conn.config_resetstat()
            for _ in range(args.repeats):
                seconds, latencies = asyncio.run(_load(url, args.sessions, args.turns, args.sessions, args.mode))
                turns_done += len(latencies)
                rates.append(len(latencies) / seconds)
                p50s.append(percentile(latencies, 0.5))
                p99s.append(percentile(latencies, 0.99))
            cpu = {name: (sum(_cpu_s(p) for p in (ids if isinstance(ids, list) else [ids])) - cpu_before[name])
                   / turns_done * 1000 for name, ids in pids.items()}
            print(f"throughput ({args.mode}), {args.sessions} concurrent sessions x {args.turns} turns, "
                  f"{args.workers} worker(s), "
                  f"median of {args.repeats}: {statistics.median(rates):.0f} turns/s (min {min(rates):.0f}, "
                  f"max {max(rates):.0f}); turn latency under that load p50 {statistics.median(p50s) * 1000:.0f} ms, "
                  f"p99 {statistics.median(p99s) * 1000:.0f} ms")
            loaded = _command_counts(conn)
            print(f"Redis work under that load: {sum(loaded.values()) / turns_done:.1f} commands per turn "
                  "(goal: at most 12)")
            print(f"  by command: {_profile(loaded, turns_done)}")
            per = ", ".join(f"{name} {ms:.2f} ms" for name, ms in cpu.items())
            print(f"CPU per turn under that load: {per}"
                  + f" ({sum(cpu.values()):.2f} ms in all, on {os.cpu_count()} cores)")

            if args.shard_turns:
                before = {c.job_id for c in commit_log.read_all(conn, run)}
                sessions = -(-args.shard_turns // args.turns)
                seconds, latencies = asyncio.run(_load(url, sessions, args.turns, args.sessions, args.mode))
                deadline = time.monotonic() + 60
                while conn.xlen(keys.turn_log(run)) and time.monotonic() < deadline:
                    time.sleep(0.5)  # the last turns reach a shard once the oldest is 10 s old
                commits = [c for c in commit_log.read_all(conn, run) if c.job_id not in before]
                rows = sum(c.rows for c in commits)
                print(f"shards: a run of {len(latencies)} turns ({len(latencies) / seconds:.0f} turns/s) left "
                      f"{len(commits)} shard files holding {rows} rows: {rows / max(1, len(commits)):.0f} turns per "
                      f"shard (goal: at most 1 shard per 256 turns)")
        finally:
            stop_processes(procs)


if __name__ == "__main__":
    main()
