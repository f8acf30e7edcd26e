"""A server's turn counts: summed in memory and written together (a real redis-server)."""

from __future__ import annotations

import redis

from pipeline.core.broker import keys
from pipeline.serve.sessions import Placed
from pipeline.serve.turn_counts import TurnCounts

POOL = keys.pool(None)


def _stats(conn: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in conn.hgetall(POOL.turn_stats).items()}


def test_counts_reach_redis_at_the_flush_all_together(redis_client: redis.Redis) -> None:
    counts = TurnCounts(redis_client, every_s=3600)  # flushed by hand here
    home = Placed("w1", "w1", None, prompt_tokens=100, cached_tokens=80)
    moved = Placed("w2", "w2", "full", prompt_tokens=50, cached_tokens=0)
    counts.add(POOL, "r", home.increments("w1"))
    counts.add(POOL, "r", moved.increments("w1"))
    counts.add(POOL, "other", Placed("w1", None, None, prompt_tokens=10, cached_tokens=0).increments(None))
    assert _stats(redis_client) == {}
    counts.flush()
    assert _stats(redis_client) == {"turns": 3, "prompt_tokens": 160, "cached_tokens": 80, "homed_turns": 2,
                                    "home_turns": 1, "moves:full": 1}
    assert redis_client.hgetall(keys.run_turn_stats("r")) == {b"turns": b"2"}
    buckets = [k for k in redis_client.scan_iter(f"{keys.PREFIX}:turn-rate:*")]
    assert sum(int(redis_client.get(k)) for k in buckets) == 3 and all(redis_client.ttl(k) > 0 for k in buckets)
    counts.flush()  # nothing new: nothing written twice
    assert _stats(redis_client)["turns"] == 3


def test_counts_a_flush_could_not_write_go_with_the_next_one(redis_client: redis.Redis) -> None:
    gone = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens there
    counts = TurnCounts(gone, every_s=3600)
    counts.add(POOL, "r", Placed("w1", None, None, prompt_tokens=5, cached_tokens=0).increments(None))
    counts.flush()  # fails, logged
    counts.conn = redis_client  # Redis is back
    counts.flush()
    assert _stats(redis_client) == {"turns": 1, "prompt_tokens": 5, "cached_tokens": 0}


def test_counts_without_a_period_are_written_with_each_turn(redis_client: redis.Redis) -> None:
    counts = TurnCounts(redis_client, every_s=0)
    counts.add(POOL, "r", Placed("w1", None, None, prompt_tokens=5, cached_tokens=0).increments(None))
    assert _stats(redis_client)["turns"] == 1
