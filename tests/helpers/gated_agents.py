"""Agents that count themselves in Redis and wait to be let go, so that a test can see how many
episodes one agent worker runs at once (`tests/workers/agents/test_concurrency_cap.py`).

Each episode, on start, increments `RUNNING` and appends the count it saw to `PEAKS`; then it
blocks until the test pushes a token onto `RELEASE`; then it makes one model call (token ids: an
episode without a turn has nothing to train on) and decrements `RUNNING`. Two names, two agents (an
agent worker reads one episode stream per agent).
"""

from __future__ import annotations

import os
from typing import Any

import redis.asyncio

RUNNING = "test:gated:running"
PEAKS = "test:gated:peaks"
RELEASE = "test:gated:release"


async def gated(task: dict[str, Any], client: Any, episode: Any) -> float:
    conn = redis.asyncio.Redis.from_url(os.environ["PIPELINE_REDIS_URL"])
    try:
        await conn.rpush(PEAKS, await conn.incr(RUNNING))
        await conn.blpop([RELEASE], timeout=0)
        await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2)
        await conn.decr(RUNNING)
    finally:
        await conn.aclose()
    return 1.0


gated_too = gated
