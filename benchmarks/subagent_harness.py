"""A sub-agent harness on the sim: parallel sub-agents in one session against the same calls serialized.

    .venv/bin/python benchmarks/subagent_harness.py [--episodes 200] [--concurrency 16] [--repeats 2]

Everything real but the model: a `redis-server`, `pipeline serve` (its own process), two `pipeline
worker --engine sim` processes (`--sim-step-ms` a decode step, completions lognormal around
`--sim-median-tokens`), and the harness as asyncio tasks over httpx, token-id completions at
`/sessions/<id>/v1/completions`. `--episodes` episodes, `--concurrency` at a time, each one session:

- a main agent of 6 calls (a system prompt and a task, then each call extending the last one's
  prompt + answer + tool results);
- after each main call, 4 sub-agents, each a root of its own (a sub-agent system prompt all share,
  a task of its own), 1-2 calls (the second extending the first with a tool result); their answers
  go back into the main agent's next call as tool results;
- one compaction: after main call 3 the main agent restarts from its system prompt, the task and a
  summary (a new root).

Two arms, the same harness, in the same run, alternating per round (`--repeats` rounds each):
- parallel: the 4 sub-agents of a main call run at once (`asyncio.gather`): a session as a tree
  of calls allows it;
- serialized: the same calls one after another: the path before sessions were trees (a second
  call in flight in a session was a 409).

Figures (all the sim's): per arm the median episode wall time (p10-p90) and turns/s (calls a second
over a round), the ratio parallel / serialized; then from `pipeline.read_trajectories` of each
run and `pipeline.read.trees.token_tree` per episode: the training tokens of the flattened
lineages against the packed trees (each lineage checked to be one the harness made: 26 an episode,
each starting at a root).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pipeline  # noqa: E402
from benchmarks.common import free_port, percentile, wait_for_serve  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.read.trees import token_tree  # noqa: E402

PIPELINE = [sys.executable, "-m", "pipeline.cli.main"]
MAIN_CALLS, SUB_AGENTS, COMPACT_AFTER = 6, 4, 3
# Lengths in tokens: system prompts, tasks, tool results, the compaction's summary.
MAIN_SYSTEM, SUB_SYSTEM, TASK, SUB_TASK, TOOL, SUMMARY = 400, 200, 100, 50, 60, 150
LINEAGES = 2 + MAIN_CALLS * SUB_AGENTS  # the main agent's two roots, one per sub-agent


class Harness:
    """The episodes of one arm over one HTTP client."""

    def __init__(self, client: httpx.AsyncClient, url: str, run: str, parallel: bool, max_tokens: int) -> None:
        self.client, self.url, self.run, self.parallel, self.max_tokens = client, url, run, parallel, max_tokens
        self.calls = 0
        rng = random.Random(0)
        self.main_system = [rng.randrange(2000, 30000) for _ in range(MAIN_SYSTEM)]
        self.sub_system = [rng.randrange(2000, 30000) for _ in range(SUB_SYSTEM)]

    async def call(self, sid: str, prompt: list[int]) -> list[int]:
        """One completion; the prompt + its answer."""
        body = {"model": "m", "prompt": prompt, "max_tokens": self.max_tokens}
        answer = await self.client.post(f"{self.url}/sessions/{sid}/v1/completions", json=body)
        if answer.status_code != 200:
            raise SystemExit(f"session {sid} of run {self.run}: HTTP {answer.status_code}: {answer.text}")
        self.calls += 1
        return prompt + answer.json()["choices"][0]["token_ids"]

    async def sub_agent(self, sid: str, rng: random.Random) -> list[int]:
        """A sub-agent of 1-2 calls; its last answer's tokens."""
        prompt = self.sub_system + ids(rng, SUB_TASK)
        context = await self.call(sid, prompt)
        if rng.random() < 0.5:
            prompt = context + ids(rng, TOOL)
            context = await self.call(sid, prompt)
        return context[len(prompt):]

    async def episode(self, seed: int) -> float:
        """One episode; its wall time."""
        rng = random.Random(seed)
        started = time.perf_counter()
        sid = (await self.client.post(f"{self.url}/sessions", json={"run": self.run})).json()["session_id"]
        task = ids(rng, TASK)
        context = self.main_system + task
        for step in range(MAIN_CALLS):
            if step == COMPACT_AFTER:
                context = self.main_system + task + ids(rng, SUMMARY)
            context = await self.call(sid, context)
            seeds = [rng.randrange(1 << 30) for _ in range(SUB_AGENTS)]
            if self.parallel:
                answers = await asyncio.gather(*(self.sub_agent(sid, random.Random(s)) for s in seeds))
            else:
                answers = [await self.sub_agent(sid, random.Random(s)) for s in seeds]
            context = context + [t for answer in answers for t in answer]
        return time.perf_counter() - started


def ids(rng: random.Random, mean: int) -> list[int]:
    """Random token ids, a length uniform in ±50 % of `mean`."""
    return [rng.randrange(2000, 30000) for _ in range(rng.randrange(mean // 2, mean * 3 // 2 + 1))]


async def arm(url: str, run: str, parallel: bool, args: argparse.Namespace, round_: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency * SUB_AGENTS)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        harness = Harness(client, url, run, parallel, args.max_tokens)
        gate = asyncio.Semaphore(args.concurrency)

        async def gated(seed: int) -> float:
            async with gate:
                return await harness.episode(seed)

        started = time.perf_counter()
        walls = await asyncio.gather(*(gated(round_ * 100_003 + i) for i in range(args.episodes)))
        seconds = time.perf_counter() - started
    return {"walls": walls, "seconds": seconds, "calls": harness.calls}


def tree_tokens(conn: redis.Redis, run: str) -> tuple[int, int, int]:
    """Lineage tokens, packed-tree tokens (per episode) and episodes of a run; checks the lineages."""
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in pipeline.read_trajectories(run, conn=conn, rewards={}).to_pylist():
        by_session[row["session_id"]].append(row)
    flat = packed = 0
    for sid, rows in by_session.items():
        roots = sum(r["parent_turn"] is None for r in rows)
        if len(rows) != LINEAGES or roots != LINEAGES:
            raise SystemExit(f"session {sid} of run {run}: {len(rows)} lineages, {roots} from a root; the harness "
                             f"made {LINEAGES}, each a root: a server bug (a wrong parent)")
        flat += sum(len(r["input_ids"]) for r in rows)
        packed += token_tree(rows).tokens
    return flat, packed, len(by_session)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (p10 {percentile(values, 0.1):.2f}, p90 {percentile(values, 0.9):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16, help="episodes at a time")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of each arm")
    parser.add_argument("--sim-step-ms", default="5", help="the sim's decode step")
    parser.add_argument("--sim-median-tokens", default="30", help="the sim's median completion")
    parser.add_argument("--max-tokens", type=int, default=48, help="each call's max_tokens")
    args = parser.parse_args()
    sim = ["--sim-step-ms", args.sim_step_ms, "--sim-median-tokens", args.sim_median_tokens,
           "--sim-p99-tokens", str(args.max_tokens), "--heartbeat-interval", "0.5", "--log-level", "WARNING"]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as redis_server:
        conn = redis.Redis.from_url(redis_server.url)
        env = {**os.environ, "PIPELINE_REDIS_URL": redis_server.url, "PIPELINE_OUTPUT": f"file://{tmp}/shards",
               "PIPELINE_STATE_DIR": f"{tmp}/state", "PYTHONPATH": str(ROOT)}
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        commands = [["serve", "--port", str(port), "--turn-timeout", "300"],
                    *(["worker", "--engine", "sim", *sim] for _ in range(2))]
        procs = [subprocess.Popen([*PIPELINE, *command], env=env, stdout=open(f"{tmp}/{i}.log", "w"),  # noqa: SIM115
                                  stderr=subprocess.STDOUT) for i, command in enumerate(commands)]
        try:
            wait_for_serve(url, 2)
            print(f"sim: 2 workers, {args.sim_step_ms} ms a decode step, completions median {args.sim_median_tokens} "
                  f"tokens (max {args.max_tokens}); {args.episodes} episodes, {args.concurrency} at a time; "
                  f"{MAIN_CALLS} main calls, {SUB_AGENTS} sub-agents of 1-2 calls after each, one compaction "
                  "(figures are the sim's)", flush=True)
            results: dict[str, list[dict[str, Any]]] = {"parallel": [], "serialized": []}
            for round_ in range(args.repeats):
                for name in (("parallel", "serialized") if round_ % 2 == 0 else ("serialized", "parallel")):
                    result = asyncio.run(arm(url, f"{name}-{round_}", name == "parallel", args, round_))
                    results[name].append(result)
                    print(f"  {name}-{round_}: {result['calls']} calls in {result['seconds']:.1f} s, "
                          f"{result['calls'] / result['seconds']:.1f} turns/s, episode {spread(result['walls'])}",
                          flush=True)
            for name, rounds in results.items():
                walls = [w for r in rounds for w in r["walls"]]
                rates = [r["calls"] / r["seconds"] for r in rounds]
                print(f"{name}: episode wall time {spread(walls)}; turns/s {statistics.median(rates):.1f} "
                      f"(min {min(rates):.1f}, max {max(rates):.1f})")
            wall_ratio = [statistics.median(p["walls"]) / statistics.median(s["walls"])
                          for p, s in zip(results["parallel"], results["serialized"], strict=True)]
            rate_ratio = [(p["calls"] / p["seconds"]) / (s["calls"] / s["seconds"])
                          for p, s in zip(results["parallel"], results["serialized"], strict=True)]
            print(f"parallel / serialized: episode wall time {statistics.median(wall_ratio):.2f}x "
                  f"(rounds {min(wall_ratio):.2f}-{max(wall_ratio):.2f}), turns/s {statistics.median(rate_ratio):.2f}x "
                  f"(rounds {min(rate_ratio):.2f}-{max(rate_ratio):.2f})")
            for name in results:
                flat, packed, episodes = tree_tokens(conn, f"{name}-0")
                print(f"training tokens, {name}-0 ({episodes} episodes, {LINEAGES} lineages each): flattened lineages "
                      f"{flat:,}, packed trees (one per episode) {packed:,}: {flat / packed:.2f}x")
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"whole run {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
