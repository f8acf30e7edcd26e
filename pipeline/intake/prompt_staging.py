"""A job's prompt ids (and request ids) written to Redis ahead of the job, from a background thread.

A submit stages each job's raw prompt ids under `pipeline:prompts:<job id>`, and adds its request
ids to the submit's staged id set (`pipeline.intake.run_ids`), in one round trip while it goes on
parsing and packing the next lines, so Redis copies them (and appends them to its AOF) on
another core instead of all at once inside the final transaction. Staged keys are invisible to
workers until that transaction enqueues their jobs; they expire after `STAGED_TTL_S` if it never
comes (a crashed submitter), and a failed submit deletes them. `confirm` is the transaction's
first half: it WATCHes the staged prompt keys and checks they are all there, so the enqueue fails
(and nothing is enqueued) if any vanished before it (`run_ids.refuse_taken` does so for the ids).
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import redis
from redis.client import Pipeline

from pipeline.errors import PipelineError
from pipeline.intake import run_ids

# Long enough for any submit to reach its transaction, short enough that a crashed submitter's
# staged ids do not linger; the transaction sets the jobs' own TTL.
STAGED_TTL_S = 3600
# Staging writes allowed in flight before the submitter waits for the oldest (bounds the memory
# held in packed ids when Redis is slower than parsing).
_MAX_IN_FLIGHT = 8


class PromptStager:
    """Writes each job's (key, raw ids, request ids) in the background; `wait` re-raises the first failure.
    `ids_key` is the submit's staged id set."""

    def __init__(self, conn: redis.Redis, ids_key: str) -> None:
        self._conn = conn
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-staging")
        self._in_flight: deque[Future[None]] = deque()
        self.keys: list[str] = []
        self.ids_key = ids_key

    def stage(self, key: str, value: bytes | memoryview, request_ids: list[str]) -> None:
        self.keys.append(key)
        while len(self._in_flight) >= _MAX_IN_FLIGHT:
            self._in_flight.popleft().result()
        self._in_flight.append(self._pool.submit(self._write, key, value, request_ids))

    def _write(self, key: str, value: bytes | memoryview, request_ids: list[str]) -> None:
        with self._conn.pipeline(transaction=False) as pipe:
            pipe.set(key, value, ex=STAGED_TTL_S)
            run_ids.stage(pipe, self.ids_key, request_ids, STAGED_TTL_S)
            pipe.execute()

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
            staged = [*self.keys, self.ids_key]
            for start in range(0, len(staged), 1000):
                self._conn.delete(*staged[start : start + 1000])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
