"""A real Redis that refuses writes as a master cut off from its replicas does (`NOREPLICAS`, from
`min-replicas-to-write 1` with no replica), and the count of its refusals (`INFO commandstats`)."""

from __future__ import annotations

import redis


def refuse_writes(conn: redis.Redis) -> None:
    """From now on every write is refused with `NOREPLICAS` until `allow_writes`."""
    conn.config_set("min-replicas-to-write", 1)


def allow_writes(conn: redis.Redis) -> None:
    conn.config_set("min-replicas-to-write", 0)


def refusals(conn: redis.Redis) -> int:
    """How many commands (scripts included) the server has refused or failed since it started, not
    counting redis-py's `CLIENT SETINFO` (an unknown command to Redis 6, sent on every connect)."""
    stats = conn.info("commandstats")
    return sum(int(counts.get("rejected_calls", 0)) + int(counts.get("failed_calls", 0))
               for command, counts in stats.items() if command != "cmdstat_client")
