"""Prompt ids written to Redis ahead of their jobs, from a background thread.

A submit stages each job's raw prompt ids under `pipeline:prompts:<job id>` while it goes on
parsing and packing the next lines, so Redis copies them (and appends them to its AOF) on
another core instead of all at once inside the final transaction. Staged keys are invisible to
workers until that transaction enqueues their jobs; they expire after `STAGED_TTL_S` if it never
comes (a crashed submitter), and a failed submit deletes them. `confirm` is the transaction's
first half: it WATCHes the staged keys and checks they are all there, so the enqueue fails
(and nothing is enqueued) if any vanished before it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import redis
from redis.client import Pipeline

from pipeline.core.errors import PipelineError

# Long enough for any submit to reach its transaction, short enough that a crashed submitter's
# staged ids do not linger; the transaction sets the jobs' own TTL.
STAGED_TTL_S = 3600
# Staging writes allowed in flight before the submitter waits for the oldest (bounds the memory
# held in packed ids when Redis is slower than parsing).
_MAX_IN_FLIGHT = 8


class PromptStager:
    """Writes (key, raw ids) pairs in the background; `wait` re-raises the first failure."""

    def __init__(self, conn: redis.Redis) -> None:
        self._conn = conn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-staging")
        self._in_flight: deque[Future[None]] = deque()
        self.keys: list[str] = []

    def stage(self, key: str, value: bytes | memoryview) -> None:
        self.keys.append(key)
        while len(self._in_flight) >= _MAX_IN_FLIGHT:
            self._in_flight.popleft().result()
        self._in_flight.append(self._pool.submit(self._write, key, value))

    def _write(self, key: str, value: bytes | memoryview) -> None:
        self._conn.set(key, value, ex=STAGED_TTL_S)

    def wait(self) -> None:
        """Every staged write done (the first failure raised here)."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def confirm(self, pipe: Pipeline) -> None:
        """WATCH the staged keys on `pipe` (which then must run MULTI/EXEC) and check they exist."""
        self.wait()
        if not self.keys:
            return
        pipe.watch(*self.keys)
        present = pipe.exists(*self.keys)
        if present != len(self.keys):
            raise PipelineError(
                f"{len(self.keys) - present} of {len(self.keys)} staged prompt-id keys vanished from Redis "
                "before the jobs were enqueued (evicted or flushed?); nothing was enqueued, submit again"
            )

    def discard(self) -> None:
        """Delete what was staged (a failed submit); best effort, the keys expire anyway."""
        with contextlib.suppress(Exception):
            for future in self._in_flight:
                future.cancel()
            self._pool.shutdown(wait=True)
            for start in range(0, len(self.keys), 1000):
                self._conn.delete(*self.keys[start : start + 1000])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
