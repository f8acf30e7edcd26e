"""The server's CPU to place a call in a session's tree, at session sizes 10, 100 and 1 000 calls.

    .venv/bin/python benchmarks/session_tree.py [--sizes 10 100 1000] [--repeats 200]

A session as a sub-agent harness makes it: a main conversation and sub-agents, each a short
conversation of its own (a system prompt, a task, 4 replies), so the session grows by branches, not
by one conversation getting longer. At each size the next call (a sub-agent's fifth turn) is placed
`--repeats` times: the server's work to find the call it extends — digest its messages
(`Conversation`), look the reply keys up and claim the call (`SessionStore.open`: one script on a real `redis-server`),
decode the parent's record. CPU of this process (`time.process_time`) and wall time, median and
spread (p10-p90).

Baseline, in the same run: what a competent implementation without an index does — read the
session's committed calls and compare the new call's conversation with each one's (`HGETALL` of the
records, then a digest comparison per call): O(calls). Both give the same parent (checked).

This is the placement alone, not the rendering of what follows (the same in both) nor the queue.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.broker import keys  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.serve.answers import canonical_assistant  # noqa: E402
from pipeline.serve.conversation import Conversation  # noqa: E402
from pipeline.serve.sessions import (  # noqa: E402
    Choice,
    Pending,
    Placed,
    SessionStore,
    TurnRecord,
)

TURNS_PER_AGENT = 4
PROMPT_TOKENS = 300
REPLY_TOKENS = 40


def _conversation(agent: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful research sub-agent." * 8},
                                      {"role": "user", "content": f"Task {agent}: look into topic {agent}."}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"agent {agent} finding {turn}"},
                     {"role": "user", "content": f"tool result {turn} for agent {agent}"}]
    return messages


def _build(store: SessionStore, session_id: str, calls: int) -> list[dict[str, Any]]:
    """A session of `calls` committed calls (sub-agents of `TURNS_PER_AGENT` calls each); the messages of
    the next call of its last sub-agent."""
    store.create(run="bench", pool="default", output="file:///tmp/x", session_id=session_id)
    made = 0
    agent = 0
    while made < calls:
        for turn in range(TURNS_PER_AGENT):
            if made == calls:
                break
            messages = _conversation(agent, turn)  # extends its call `turn - 1`, which replied "finding turn - 1"
            conversation = Conversation(messages)
            parent = None if turn == 0 else (made - 1, 0)
            pending = Pending("abcdef", f"d{made}", conversation.whole(), len(messages))
            opened = store.open(session_id, same=None, claim=pending, pool="default")
            number = opened.turn
            assert number is not None
            reply = {"role": "assistant", "content": f"agent {agent} finding {turn}"}
            prompt = list(range(PROMPT_TOKENS + 50 * turn))
            record = TurnRecord(number, pending.turn_id(session_id, number), f"d{made}", conversation.whole(),
                                len(messages), prompt, None,
                                [Choice(list(range(REPLY_TOKENS)), reply["content"], canonical_assistant(reply))],
                                {"id": f"chatcmpl-{number}"}, parent, "w1")
            store.record(opened.session, record, (1, 1), Placed("w1", "w1", None, len(prompt), 0), conversation,
                         "w1", prefix_break=False)
            made += 1
        agent += 1
    # The next call of the last sub-agent that made all its turns: extends its last call.
    last_full = (calls // TURNS_PER_AGENT) - 1
    return _conversation(last_full, TURNS_PER_AGENT)


def _place_indexed(store: SessionStore, session_id: str, messages: list[dict[str, Any]]) -> int:
    conversation = Conversation(messages)
    reply_keys = [conversation.reply_key(j, canonical_assistant(messages[j]))
                  for j in range(len(messages) - 2, -1, -1) if messages[j].get("role") == "assistant"]
    opened = store.open(session_id, same=None, claim=Pending("abcdef", "next", conversation.whole(), len(messages)),
                        pool="default", reply_keys=reply_keys)
    assert opened.parent is not None
    return opened.parent.turn


def _place_by_scan(conn: redis.Redis, session_id: str, messages: list[dict[str, Any]]) -> int:
    """Without the index: every committed call read and compared (the longest conversation it extends)."""
    conversation = Conversation(messages)
    best, best_length = -1, -1
    for field, raw in conn.hgetall(keys.session_calls(session_id)).items():
        if not field.startswith(b"r:"):
            continue
        record = TurnRecord.from_json(raw)
        n = record.n_messages
        if n + 1 < len(messages) and conversation.first(n) == record.conversation and n > best_length:
            reply = canonical_assistant(messages[n])
            if any(c.assistant == reply for c in record.choices):
                best, best_length = record.turn, n
    return best


def _measure(fn: Callable[[], int], repeats: int) -> tuple[list[float], list[float], int]:
    cpu, wall, got = [], [], -1
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        got = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall, got


def _fmt(values: list[float]) -> str:
    ordered = sorted(values)
    p10, p90 = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10]
    return f"{statistics.median(values) * 1e3:7.3f} ms (p10-p90 {p10 * 1e3:.3f}-{p90 * 1e3:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        store = SessionStore(conn, max_calls=max(args.sizes) + 2 * args.repeats + 10)  # each placement claims a call
        print(f"placing a sub-agent's 5th call (a session of sub-agents, {TURNS_PER_AGENT} calls each), "
              f"{args.repeats} repeats; CPU of the server's process, then wall")
        first_cpu = None
        for size in args.sizes:
            session_id = f"bench-{size}"
            messages = _build(store, session_id, size)
            cpu, wall, indexed = _measure(functools.partial(_place_indexed, store, session_id, messages), args.repeats)
            scan_repeats = max(5, args.repeats // max(1, size // 10))
            scan_cpu, scan_wall, scanned = _measure(functools.partial(_place_by_scan, conn, session_id, messages),
                                                    scan_repeats)
            assert indexed == scanned, (indexed, scanned)
            first_cpu = first_cpu or statistics.median(cpu)
            print(f"  {size:5d} calls: index  cpu {_fmt(cpu)}  wall {_fmt(wall)}  "
                  f"(x{statistics.median(cpu) / first_cpu:.2f} the smallest session's CPU)")
            print(f"  {size:5d} calls: scan   cpu {_fmt(scan_cpu)}  wall {_fmt(scan_wall)}  "
                  f"(baseline; index/scan CPU {statistics.median(cpu) / statistics.median(scan_cpu):.3f})")


if __name__ == "__main__":
    main()
