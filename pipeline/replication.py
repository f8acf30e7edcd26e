"""Acknowledged means replicated: after a write the pipeline reports as done, wait for replicas.

Redis replicates asynchronously, so a master that dies can take its last writes with it. Where
the pipeline tells someone "done" (a submit's enqueue, a commit-log append, a control state
change, a weight acknowledgement) it calls `replicated(conn, what)`, which waits with `WAIT`
until that many replicas have everything written so far:

- `PIPELINE_REDIS_WAIT_REPLICAS`: `auto` (default) waits for one replica when the master has any
  connected (checked at most every `CHECK_EVERY_S` per client) and not at all when it has none;
  a number waits for that many; `0` turns the wait off.
- `PIPELINE_REDIS_WAIT_TIMEOUT_MS` (default 1000): how long to wait. A timeout is reported, not
  raised: the write is on the master and stays acknowledged; a warning says how many replicas
  confirmed it, since a failover in that window could lose it. A commit lost that way is found
  again (its job re-runs and rewrites the same shard), a lost enqueue is not: watch for these.

`WAIT` counts the writes of the connection it runs on, and the write being acknowledged may have
gone out on another connection of the pool; so the wait first makes one tiny write of its own on
its connection (replication is ordered: a replica that has it has everything before it).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

import redis

from pipeline import keys

ENV_WAIT_REPLICAS = "PIPELINE_REDIS_WAIT_REPLICAS"
ENV_WAIT_TIMEOUT_MS = "PIPELINE_REDIS_WAIT_TIMEOUT_MS"
DEFAULT_TIMEOUT_MS = 1000
CHECK_EVERY_S = 5.0

log = logging.getLogger(__name__)
_replicas_seen: weakref.WeakKeyDictionary[Any, tuple[float, int]] = weakref.WeakKeyDictionary()


def wanted_replicas(conn: redis.Redis) -> int:
    """How many replicas a write must reach before it counts as acknowledged (0: no wait)."""
    setting = os.environ.get(ENV_WAIT_REPLICAS, "auto").strip().lower()
    if setting != "auto":
        if not setting.isdigit():
            raise ValueError(f"{ENV_WAIT_REPLICAS}={setting!r}: use auto, 0 (off) or a number of replicas")
        return int(setting)
    pool = conn.connection_pool
    now = time.monotonic()
    seen = _replicas_seen.get(pool)
    if seen is None or now - seen[0] > CHECK_EVERY_S:
        try:
            connected = int(conn.info("replication").get("connected_slaves", 0))
        except redis.ResponseError:  # a server without INFO (fakeredis): no replicas to wait for
            connected = 0
        seen = (now, connected)
        _replicas_seen[pool] = seen
    return 1 if seen[1] > 0 else 0


def timeout_ms() -> int:
    raw = os.environ.get(ENV_WAIT_TIMEOUT_MS, str(DEFAULT_TIMEOUT_MS))
    if not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"{ENV_WAIT_TIMEOUT_MS}={raw!r}: use a positive number of milliseconds")
    return int(raw)


def replicated(conn: redis.Redis, what: str) -> int | None:
    """Wait until the configured number of replicas has every write so far; the number that confirmed
    (None when no wait is configured). `what` names the write for the warning on a timeout."""
    want = wanted_replicas(conn)
    if want == 0:
        return None
    limit = timeout_ms()
    with conn.pipeline(transaction=False) as pipe:  # one connection: the probe write, then WAIT for it
        pipe.incr(keys.REPLICATION_PROBE)
        pipe.execute_command("WAIT", want, limit)
        confirmed = int(pipe.execute()[1])
    if confirmed < want:
        log.warning("%s: written on the Redis master but %d of %d replica(s) confirmed it within %d ms "
                    "(%s); a failover now could lose it", what, confirmed, want, limit, ENV_WAIT_TIMEOUT_MS)
    return confirmed
