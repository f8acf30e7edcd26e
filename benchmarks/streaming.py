"""Streamed agent turns: how soon the first text reaches the client, against the whole turn.

    .venv/bin/python benchmarks/streaming.py [--turns 12] [--tokens 64] [--step-ms 20] [--concurrent 16]

Everything real but the model: a `redis-server` set up as the embedded default is, `pipeline serve`
(its own process), one `pipeline worker` process around the sim engine decoding one token every
`--step-ms` (continuous batching, `--tokens` tokens an answer), and clients over httpx. One
session at a time (then `--concurrent` sessions at once), alternating a streamed call
(`stream: true`) and the same call not streamed, each a fresh session with the same prompt:

- time to first text: from the request to the first SSE chunk with content, streamed;
- the whole turn: to `[DONE]` (streamed) and to the answer (not streamed). Before turns were
  streamed live, a streamed call got its first text when the whole turn was done: the
  non-streamed turn is that baseline, measured in the same run;
- the sim's own figures (labelled): its first token after one step, its last after `--tokens`
  steps: the floor the pipeline adds to;
- Redis commands per turn, streamed and not (what the token stream costs).

Prints medians with their spread and the load average.
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

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, stop_processes, wait_for_serve  # noqa: E402
from pipeline.core import settings  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402

TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "tiny-tools"


def _worker(url: str, tokens: int, step_s: float) -> None:
    from transformers import AutoTokenizer

    from workers.engines.sim.engine import SimConfig, SimEngine
    from workers.process.worker import RolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    engine = SimEngine(SimConfig(median_tokens=tokens, p99_tokens=tokens, vocab_size=len(tokenizer), step_s=step_s,
                                 eos_token_id=tokenizer.eos_token_id))
    RolloutWorker(redis.Redis.from_url(url), engine).work(burst=False, with_scheduler=False, logging_level="WARNING")


def _server(url: str, port: int, output: str) -> None:
    from pipeline.serve.server import ServeConfig, Server

    Server(ServeConfig(port=port, redis_url=url, tokenizer=str(TOKENIZER), run="bench", output=output,
                       turn_timeout_s=120)).run()


def _body(tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens,
            "stream": stream, "ignore_eos": True}


async def _turn(client: httpx.AsyncClient, url: str, tokens: int, stream: bool) -> tuple[float | None, float]:
    """(seconds to the first text or None when not streamed, seconds to the whole turn) of one call."""
    created = await client.post(f"{url}/sessions", json={})
    sid = created.json()["session_id"]
    started = time.perf_counter()
    route = f"{url}/sessions/{sid}/v1/chat/completions"
    if not stream:
        answer = await client.post(route, json=_body(tokens, False))
        answer.raise_for_status()
        return None, time.perf_counter() - started
    first = None
    async with client.stream("POST", route, json=_body(tokens, True)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line \
                    and '"content":""' not in line:
                first = time.perf_counter() - started
            if line == "data: [DONE]":
                break
            if line.startswith('data: {"error"'):
                raise SystemExit(f"the stream failed: {line}")
    return first, time.perf_counter() - started


async def _round(url: str, tokens: int, sessions: int, stream: bool) -> list[tuple[float | None, float]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(_turn(client, url, tokens, stream) for _ in range(sessions))))


def _commands(conn: redis.Redis) -> int:
    return sum(stat["calls"] for name, stat in conn.info("commandstats").items()
               if name not in ("cmdstat_info", "cmdstat_config"))


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f}, "
            f"max {max(values) * 1000:.0f})")


def _measure(url: str, conn: redis.Redis, turns: int, tokens: int, sessions: int) -> None:
    first: list[float] = []
    whole_streamed: list[float] = []
    whole_plain: list[float] = []
    commands = {True: 0, False: 0}
    for _ in range(turns):
        for stream in (True, False):
            before = _commands(conn)
            results = asyncio.run(_round(url, tokens, sessions, stream))
            commands[stream] += _commands(conn) - before
            for ttft, whole in results:
                (whole_streamed if stream else whole_plain).append(whole)
                if ttft is not None:
                    first.append(ttft)
    n = turns * sessions
    ratio = [f / w for f, w in zip(first, whole_plain, strict=True)]
    print(f"{sessions} session(s) at once, {n} turns each way, load average {os.getloadavg()[0]:.1f}:")
    print(f"  time to first text, streamed: {_spread(first)}")
    print(f"  whole turn, streamed:         {_spread(whole_streamed)}")
    print(f"  whole turn, not streamed:     {_spread(whole_plain)}  (the first text before live streaming)")
    print(f"  first text / whole turn: {statistics.median(ratio):.3f} (min {min(ratio):.3f}, max {max(ratio):.3f}); "
          f"streamed whole / not streamed: {statistics.median(whole_streamed) / statistics.median(whole_plain):.2f}x")
    print(f"  Redis commands per turn: streamed {commands[True] / n:.1f}, not streamed {commands[False] / n:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=12, help="turns each way (streamed and not), alternating")
    parser.add_argument("--tokens", type=int, default=64, help="tokens an answer")
    parser.add_argument("--step-ms", type=float, default=20, help="the sim's decode step")
    parser.add_argument("--concurrent", type=int, default=16, help="sessions at once in the loaded rounds (0: skip)")
    args = parser.parse_args()
    step_s = args.step_ms / 1000
    print(f"the sim's own (not a measurement): first token after one step, {args.step_ms:g} ms; the whole answer "
          f"after {args.tokens} steps, {args.tokens * step_s * 1000:.0f} ms")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0,
                                                           appendfsync=settings.redis_appendfsync()) as redis_server:
        conn = redis.Redis.from_url(redis_server.url)
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(redis_server.url, args.tokens, step_s), daemon=True),
                 ctx.Process(target=_server, args=(redis_server.url, port, f"file://{tmp}/shards"), daemon=True)]
        for proc in procs:
            proc.start()
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_serve(url, 1)
            asyncio.run(_round(url, 4, 2, True))  # warm-up
            _measure(url, conn, args.turns, args.tokens, 1)
            if args.concurrent:
                _measure(url, conn, max(2, args.turns // 4), args.tokens, args.concurrent)
        finally:
            stop_processes(procs)


if __name__ == "__main__":
    main()
