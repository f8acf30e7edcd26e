"""The turn counts (the pool's, `keys.PoolKeys.turn_stats`, turns per 10-second bucket, and each
run's, `keys.run_turn_stats`), summed in the server and written in one round trip every `FLUSH_S`,
not eight commands with every turn.

`pipeline status` and `GET /metrics` read them from Redis: a count shows there up to `FLUSH_S`
after its turn was answered (a server's own `/metrics` writes its counts first), and a server that
is killed loses at most that long of counts. The session's own record and a run's prefix breaks are
written with the turn (`pipeline.serve.sessions`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import redis

from pipeline.core.broker import keys

log = logging.getLogger(__name__)

FLUSH_S = 0.5
BUCKET_TTL_S = 600


class TurnCounts:
    """Counts added by this server's turns, written every `every_s` by a thread (started on first use;
    `every_s` 0: written as they are added)."""

    def __init__(self, conn: redis.Redis, *, every_s: float = FLUSH_S) -> None:
        self.conn = conn
        self.every_s = every_s
        self._lock = threading.Lock()
        self._fields: Counter[tuple[str, str]] = Counter()
        self._buckets: Counter[str] = Counter()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, pool: keys.PoolKeys, run: str, increments: dict[str, int]) -> None:
        """One turn of `run` in `pool`, with its part in the pool's counts (`sessions.Placed.increments`)."""
        with self._lock:
            self._fields[(keys.run_turn_stats(run), "turns")] += 1
            for field, count in increments.items():
                self._fields[(pool.turn_stats, field)] += count
            self._buckets[pool.turns_in(int(time.time()) // keys.TURN_RATE_BUCKET_S)] += 1
            if self._thread is None and self.every_s > 0:
                self._thread = threading.Thread(target=self._loop, name="turn-counts", daemon=True)
                self._thread.start()
        if self.every_s <= 0:
            self.flush()

    def flush(self) -> None:
        """Write what was counted since the last flush (kept for the next one if Redis fails)."""
        with self._lock:
            fields, buckets = self._fields, self._buckets
            self._fields, self._buckets = Counter(), Counter()
        if not fields and not buckets:
            return
        try:
            with self.conn.pipeline(transaction=True) as pipe:  # a reader sees all of a flush or none
                for (key, field), count in fields.items():
                    pipe.hincrby(key, field, count)
                for bucket, count in buckets.items():
                    pipe.incrby(bucket, count)
                    pipe.expire(bucket, BUCKET_TTL_S)
                pipe.execute()
        except redis.RedisError as exc:
            log.warning("turn counts not written (%s); written with the next ones", exc)
            with self._lock:
                self._fields.update(fields)
                self._buckets.update(buckets)

    def close(self) -> None:
        self._stop.set()
        self.flush()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()
