"""Does a session's late turn cost the server more than its early one? CPU per turn at turn 2 and at
turn 64 (issue 55's target: the 64th <= 1.2x the 2nd, a turn's server work O(its new messages)).

    .venv/bin/python benchmarks/turn_growth.py [--sessions 48] [--turns 64] [--repeats 3] [--mode chat]

The set-up is `benchmarks/serve.py`'s: a real `redis-server`, `pipeline serve` and one `pipeline
worker` as their own processes, the sim at infinite speed (8 tokens a reply), agents as asyncio
tasks. `--sessions` sessions advance together, one turn each per phase (turn 1 of every session,
then turn 2 of every session, ...); each turn's history is the last one's plus the assistant's
answer and a new user message, as an agent's is (`--mode tokens`: `/v1/completions` with ids, no
template). The CPU each process used during a phase (each thread's scheduler counters, in ns),
divided by the phase's turns, is that turn number's CPU per turn. The baseline is the session's
2nd turn, in the same run: the figure is the last turns' over the early ones (each end the median
of four phases, turns 2-5 and 61-64, against one phase's noise), for the server and for the
worker, median of `--repeats` runs with min and max. Beside it, each process's CPU per turn over
the whole run (the mean of every phase), which counts the garbage collector's full collections
that the medians leave out. The sim's engine, not a model: a real engine's
prefill grows with the prompt; this is the pipeline's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, stop_processes, wait_for_serve  # noqa: E402
from benchmarks.serve import Agent, _server, _worker  # noqa: E402
from pipeline.core import settings  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402


def _threads_cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, in nanoseconds' precision (`/proc/PID/task/*/schedstat`:
    `/proc/PID/stat` counts 10 ms ticks, too coarse for a phase of a few dozen turns; a thread that
    ended during the phase takes its time with it, so the server's thread pools are warmed first)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


WINDOW = 4  # phases each end's figure is the median of: turns 2-5 and the last four


async def _phases(url: str, sessions: int, turns: int, mode: str, pids: dict[str, int]) -> list[dict[str, float]]:
    """CPU milliseconds per turn of each process, for each turn number 1..`turns`."""
    connector = aiohttp.TCPConnector(limit=sessions)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as client:
        agents = [Agent(client, url, mode) for _ in range(sessions)]
        await asyncio.gather(*(a.open() for a in agents))
        phases = []
        for _ in range(turns):
            before = {name: _threads_cpu_s(pid) for name, pid in pids.items()}
            await asyncio.gather(*(a.turn() for a in agents))
            phases.append({name: (_threads_cpu_s(pid) - before[name]) / sessions * 1000 for name, pid in pids.items()})
        return phases


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=48, help="sessions advancing together, a turn each per phase")
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=["chat", "tokens"], default="chat")
    args = parser.parse_args()
    if args.turns < 2 * WINDOW + 1:
        parser.error(f"--turns must be at least {2 * WINDOW + 1} (turns 2-{1 + WINDOW} are the baseline)")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0,
                                                           appendfsync=settings.redis_appendfsync()) as redis_server:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(redis_server.url,), daemon=True),
                 ctx.Process(target=_server, args=(redis_server.url, port, f"file://{tmp}/shards", "growth"),
                             daemon=True)]
        for proc in procs:
            proc.start()
        url = f"http://127.0.0.1:{port}"
        pids = {"server": procs[1].pid, "worker": procs[0].pid}
        try:
            wait_for_serve(url, 1)
            asyncio.run(_phases(url, 4, 3, args.mode, pids))  # warm-up: imports, templates, connections
            ratios: dict[str, list[float]] = {name: [] for name in pids}
            means: dict[str, list[float]] = {name: [] for name in pids}
            firsts: dict[str, list[float]] = {name: [] for name in pids}
            lasts: dict[str, list[float]] = {name: [] for name in pids}
            for repeat in range(args.repeats):
                phases = asyncio.run(_phases(url, args.sessions, args.turns, args.mode, pids))
                # Each end a median of WINDOW phases: a phase that a background flush or a GC lands in
                # would swing a single turn's figure.
                second, last = ({name: statistics.median(p[name] for p in window) for name in pids}
                                for window in (phases[1:1 + WINDOW], phases[-WINDOW:]))
                for name in pids:
                    means[name].append(statistics.mean(p[name] for p in phases))
                    firsts[name].append(second[name])
                    lasts[name].append(last[name])
                    ratios[name].append(last[name] / second[name])
                print(f"repeat {repeat + 1}: " + "; ".join(
                    f"{name} turns 2-{1 + WINDOW} {second[name]:.2f} ms, turns {args.turns - WINDOW + 1}-{args.turns} "
                    f"{last[name]:.2f} ms" for name in pids), flush=True)
            for name in pids:
                late = f"{args.turns - WINDOW + 1}-{args.turns}"
                print(f"{name} CPU per turn ({args.mode}, {args.sessions} sessions, median of {args.repeats}): turns "
                      f"2-{1 + WINDOW} {statistics.median(firsts[name]):.2f} ms, turns {late} "
                      f"{statistics.median(lasts[name]):.2f} ms; late / early {_spread(ratios[name])}"
                      + (" (goal for the server: at most 1.2x)" if name == "server" else ""))
            # The ends are medians of phases: a full collection lands in one phase of several, so they
            # leave it out. The mean over every phase of a run counts it.
            for name in pids:
                print(f"{name} CPU per turn over all {args.turns} turns, every phase counted (collections "
                      f"included), median of {args.repeats}: {statistics.median(means[name]):.2f} ms "
                      f"(min {min(means[name]):.2f}, max {max(means[name]):.2f})")
        finally:
            stop_processes(procs)


if __name__ == "__main__":
    main()
