"""Agent episodes through the runner against the loop a competent user writes, and the runner under fire.

    .venv/bin/python benchmarks/episodes.py [--episodes 1000] [--turns 8] [--repeats 3] [--chaos]

Everything real but the model: a `redis-server`, `pipeline serve` (its own process), two `pipeline
worker` processes around the sim engine at infinite speed (a zero-time engine: these are the
pipeline's and the runner's costs; a GPU adds its own), and the same agent in both arms
(`tests.helpers.agents:solve`: `--turns` token-id completions a episode, each extending the last
prompt with the answer and a tool result).

- runner: `pipeline submit --agent` of `--episodes` tasks (n = 1), two `pipeline agent-worker`
  processes with `--concurrency episodes/2` each; from the submit to the last outcome committed;
- baseline: the loop a user writes without the runner, in two processes with half the episodes
  each: asyncio, a semaphore of episodes/2, per episode `POST /sessions`, an `openai.AsyncOpenAI`
  bound to it, the agent, `POST .../reward`; no durability (a process that dies loses its episodes).

Each repeat runs both arms (the order alternating), on fresh runs; printed: episodes/s and turns/s
per arm, the ratio runner / baseline per repeat, medians and spread, load averages.

`--chaos`: one more runner run in which one agent worker is SIGKILLed with episodes in flight (once
a quarter of them has finished) and `pipeline serve` is SIGKILLed and restarted: episodes lost, duplicated
and the seconds until all finished, against the same run undisturbed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402

AGENT = "tests.helpers.agents:solve"
PIPELINE = [sys.executable, "-m", "pipeline.cli.main"]


def _tasks(count: int, turns: int, tag: str) -> list[dict[str, Any]]:
    return [{"id": f"{tag}-{i}", "prompt": [5 + i % 50, 6, 7], "turns": turns, "answer": i % 2, "max_tokens": 8}
            for i in range(count)]


def _wait_health(url: str, workers: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).json()["live_workers"] >= workers:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"pipeline serve at {url} or its workers did not come up")


class Stack:
    """redis-server, `pipeline serve`, two sim workers; `env` for further `pipeline` processes."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PIPELINE_REDIS_URL": redis_url, "PIPELINE_HOME": str(tmp / "state"),
                    "PYTHONPATH": str(ROOT), "PIPELINE_SERVE_URL": self.url}
        self.workers = [self.start("worker", "--engine", "sim", "--sim-step-ms", "0", "--sim-median-tokens", "8",
                                   "--sim-p99-tokens", "8", "--log-level", "WARNING", name=f"gpu{i}")
                        for i in range(2)]
        self.serve = self.start_serve()
        _wait_health(self.url, 2)

    def start(self, *args: str, name: str) -> subprocess.Popen:
        return subprocess.Popen([*PIPELINE, *args], env=self.env, stdout=(self.tmp / f"{name}.log").open("a"),
                                stderr=subprocess.STDOUT)

    def start_serve(self) -> subprocess.Popen:
        return self.start("serve", "--port", str(self.port), "--run", "bench", "--turn-timeout", "300", name="serve")

    def close(self) -> None:
        for process in [self.serve, *self.workers]:
            process.terminate()
        for process in [self.serve, *self.workers]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _held_by(conn: redis.Redis, run: str, worker: str) -> int:
    """Episodes of `run` whose attempt in flight is `worker`'s."""
    from pipeline.core.broker import keys

    return sum(1 for raw in conn.hvals(keys.episode_attempts(run)) if json.loads(raw)["worker_id"] == worker)


def runner_arm(stack: Stack, conn: redis.Redis, episodes: int, turns: int, tag: str,
               chaos: bool = False) -> dict[str, Any]:
    import pipeline

    client = pipeline.Client(conn)
    started = time.perf_counter()
    run = client.submit_episodes(_tasks(episodes, turns, tag), agent=AGENT, run=tag, retries=5)
    per = max(1, episodes // 2)
    agents = [stack.start("agent-worker", "--agent", AGENT, "--concurrency", str(per), "--claim-after", "5",
                          "--worker-id", f"{tag}-a{i}", "--burst", "--log-level", "WARNING", name=f"{tag}-a{i}")
              for i in range(2)]
    killed_at = None
    if chaos:  # once a quarter has finished, while the first agent worker holds episodes in flight
        victim = f"{tag}-a0"
        while run.counts()["finished"] < episodes // 4 or not _held_by(conn, tag, victim):
            time.sleep(0.05)
        killed_at = time.perf_counter() - started
        in_flight = _held_by(conn, tag, victim)
        agents[0].send_signal(signal.SIGKILL)
        stack.serve.send_signal(signal.SIGKILL)
        stack.serve.wait()
        stack.serve = stack.start_serve()
        _wait_health(stack.url, 2)
    counts = run.wait(timeout=3600)
    seconds = time.perf_counter() - started
    for process in agents:  # burst workers: they exit once nothing is left
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    outcomes = run.outcomes()
    result = {"seconds": seconds, "episodes": len(outcomes), "turns": sum(o.turns for o in outcomes.values()),
              "failed": counts["failed"], "abandoned": counts["abandoned"], "duplicates": counts["duplicates"]}
    if chaos:
        expected = {f"{tag}-{i}:0" for i in range(episodes)}
        result.update(killed_at=killed_at, in_flight_at_kill=in_flight, lost=len(expected - set(outcomes)),
                      extra=len(set(outcomes) - expected))
    return result


async def _baseline_episodes(url: str, tasks: list[dict[str, Any]], concurrency: int) -> int:
    """The competent user's loop: asyncio and a semaphore, a session per episode, the same agent."""
    import openai

    from tests.helpers.agents import solve

    class Episode:  # what the agent reads of its episode
        def __init__(self, sample: int) -> None:
            self.sample, self.attempt, self.session_id, self.episode_id = sample, 1, "", ""

    gate = asyncio.Semaphore(concurrency)
    turns = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(task: dict[str, Any]) -> None:
            nonlocal turns
            async with gate:
                sid = (await http.post("/sessions", json={"run": "baseline"})).json()["session_id"]
                client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused")
                result = await solve(task, client, Episode(0))
                await http.post(f"/sessions/{sid}/reward", json={"reward": result["reward"]})
                await client.close()
                turns += task["turns"]

        await asyncio.gather(*(one(task) for task in tasks))
    return turns


def _baseline_process(url: str, episodes: int, turns: int, tag: str, half: int) -> None:
    tasks = _tasks(episodes, turns, tag)[half::2]
    asyncio.run(_baseline_episodes(url, tasks, max(1, episodes // 2)))


def baseline_arm(stack: Stack, episodes: int, turns: int, tag: str) -> dict[str, Any]:
    started = time.perf_counter()
    code = ("import sys; sys.path.insert(0, {root!r}); from benchmarks.episodes import _baseline_process; "
            "_baseline_process({url!r}, {episodes}, {turns}, {tag!r}, {half})")
    processes = [subprocess.Popen([sys.executable, "-c", code.format(root=str(ROOT), url=stack.url, episodes=episodes,
                                                                      turns=turns, tag=tag, half=half)],
                                  env=stack.env) for half in (0, 1)]
    for process in processes:
        if process.wait() != 0:
            raise SystemExit(f"a baseline process failed ({process.returncode})")
    return {"seconds": time.perf_counter() - started, "episodes": episodes, "turns": episodes * turns}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chaos", action="store_true", help="also a runner run with an agent worker and the "
                                                              "server SIGKILLed mid-run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as redis_server:
        conn = redis.Redis.from_url(redis_server.url)
        stack = Stack(Path(tmp), redis_server.url)
        try:
            runner_arm(stack, conn, 20, 2, "warm")  # imports, connections, templates
            baseline_arm(stack, 20, 2, "warm-b")
            ratios, runner_rates, baseline_rates, runner_turns, baseline_turns = [], [], [], [], []
            for repeat in range(args.repeats):
                order = ["runner", "baseline"] if repeat % 2 == 0 else ["baseline", "runner"]
                got: dict[str, dict[str, Any]] = {}
                for arm in order:
                    tag = f"r{repeat}-{arm}"
                    got[arm] = (runner_arm(stack, conn, args.episodes, args.turns, tag) if arm == "runner"
                                else baseline_arm(stack, args.episodes, args.turns, tag))
                r, b = got["runner"], got["baseline"]
                runner_rates.append(r["episodes"] / r["seconds"])
                baseline_rates.append(b["episodes"] / b["seconds"])
                runner_turns.append(r["turns"] / r["seconds"])
                baseline_turns.append(b["turns"] / b["seconds"])
                ratios.append(runner_rates[-1] / baseline_rates[-1])
                print(f"repeat {repeat} ({' then '.join(order)}): runner {r['episodes']} episodes in "
                      f"{r['seconds']:.1f} s ({runner_rates[-1]:.1f}/s, {runner_turns[-1]:.0f} turns/s, "
                      f"{r['failed']} failed); baseline {b['seconds']:.1f} s ({baseline_rates[-1]:.1f}/s, "
                      f"{baseline_turns[-1]:.0f} turns/s); ratio {ratios[-1]:.3f}; load {os.getloadavg()[0]:.1f}",
                      flush=True)
            print(f"\n{args.episodes} concurrent episodes of {args.turns} turns, 2 agent workers / 2 baseline "
                  f"processes, 2 sim workers (zero-time engine), {args.repeats} repeats:")
            print(f"  runner episodes/s   {_spread(runner_rates)}   turns/s {_spread(runner_turns)}")
            print(f"  baseline episodes/s {_spread(baseline_rates)}   turns/s {_spread(baseline_turns)}")
            print(f"  runner / baseline   {_spread(ratios)}   (load averages {os.getloadavg()})")
            if args.chaos:
                calm = runner_arm(stack, conn, args.episodes, args.turns, "calm")
                fired = runner_arm(stack, conn, args.episodes, args.turns, "chaos", chaos=True)
                print(f"\nchaos: an agent worker SIGKILLed with {fired['in_flight_at_kill']} episodes in flight at "
                      f"{fired['killed_at']:.1f} s, pipeline serve SIGKILLed and restarted: {fired['lost']} lost, "
                      f"{fired['extra']} duplicated ({fired['duplicates']} duplicate runs discarded), "
                      f"{fired['abandoned']} abandoned sessions run again, {fired['failed']} failed; all finished in "
                      f"{fired['seconds']:.1f} s against {calm['seconds']:.1f} s undisturbed")
        finally:
            stack.close()


if __name__ == "__main__":
    main()
