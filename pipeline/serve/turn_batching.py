"""Turns that reach a server together travel together: a flusher thread enqueues the turns waiting
when it comes round as one job of turns (per run, output, worker class and target worker).

While the server's jobs of turns in flight already keep the pool's live workers busy (two jobs each),
new turns wait for one of those to be answered (at most `HOLD_S`), so under load a job's cost
is paid once for many turns; a turn reaching an idle pool is enqueued at once. A job goes to its
chosen worker's turn queue (`pipeline.core.jobs.turn_queue`), or to the pool's shared lane for any
worker (the same kind of stream, read by them all).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis

from pipeline.core.jobs import turn_queue
from pipeline.serve.routing import ACTIVE_S, Router
from schemas.capabilities import Needs
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest

TURN_JOB_TIMEOUT_S = 3600
TURN_RETRIES = 1
MAX_TURNS_PER_JOB = 64
HOLD_S = 0.05  # the longest a turn waits for others to share its job while the workers are busy
OUTSTANDING_S = 2.0  # a job of turns this server enqueued counts as in flight for at most this long


@dataclass
class WaitingTurn:
    """A turn handed to the flusher, and what became of it."""

    request: RolloutRequest
    turn: TurnTag
    run: str
    output: str
    needs: Needs
    group: Hashable
    worker: str | None
    home: str | None
    enqueued: Future[None] = field(default_factory=Future)  # done once its job is enqueued (or failed to be)


class TurnBatcher:
    """Enqueues one server's turns of one pool as jobs, several turns a job under load."""

    def __init__(self, conn: redis.Redis, router: Router, *, max_turns_per_job: int = MAX_TURNS_PER_JOB) -> None:
        self.conn = conn
        self.router = router
        self.keys = router.keys
        self.max_turns_per_job = max_turns_per_job
        self._waiting: list[WaitingTurn] = []
        self._ready = threading.Condition()
        self._flusher: threading.Thread | None = None
        self._jobs: dict[str, tuple[int, float]] = {}  # this server's jobs of turns: turns unanswered, enqueued at
        self._job_of_turn: dict[str, str] = {}

    async def enqueue(self, waiting: WaitingTurn) -> None:
        """Hand the turn to the flusher and return once its job is enqueued (awaited on the server's
        loop, no thread held); raise what the enqueue raised."""
        with self._ready:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="turn-flusher", daemon=True)
                self._flusher.start()
            self._waiting.append(waiting)
            self._ready.notify()
        await asyncio.wrap_future(waiting.enqueued)

    def _flush_loop(self) -> None:
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                # Flow control: while this server's earlier jobs keep the pool's workers busy, turns
                # wait here (at most HOLD_S) and go on together; an idle pool gets each turn at once.
                held_until = time.monotonic() + HOLD_S
                while (len(self._waiting) < self.max_turns_per_job and self._busy()
                       and (left := held_until - time.monotonic()) > 0):
                    self._ready.wait(left)
                batch, self._waiting = self._waiting, []
            groups: dict[Hashable, list[WaitingTurn]] = {}
            for waiting in batch:
                groups.setdefault(waiting.group, []).append(waiting)
            for group in groups.values():
                for start in range(0, len(group), self.max_turns_per_job):
                    self._enqueue_job(group[start:start + self.max_turns_per_job])

    def _busy(self) -> bool:
        """Whether this server's jobs of turns in flight are enough to keep the pool's live workers busy
        (two per worker: one running, one taken next); jobs older than `OUTSTANDING_S` no longer count."""
        now = time.monotonic()
        recent = sum(1 for _, enqueued in self._jobs.values() if now - enqueued < OUTSTANDING_S)
        return recent >= 2 * max(1, len(self.router.live_workers()))

    def answered(self, turn_id: str) -> None:
        """A turn this server enqueued is answered (or given up): its job counts down."""
        with self._ready:
            job_id = self._job_of_turn.pop(turn_id, None)
            if job_id is None or job_id not in self._jobs:
                return
            left, enqueued = self._jobs[job_id]
            if left <= 1:
                del self._jobs[job_id]
                self._ready.notify()
            else:
                self._jobs[job_id] = (left - 1, enqueued)

    def _enqueue_job(self, turns: list[WaitingTurn]) -> None:
        try:
            first = turns[0]
            job_id = f"turns-{uuid.uuid4().hex[:16]}"
            payload = JobPayload.pack([t.request for t in turns], run=first.run, job_id=job_id, batch_id=job_id,
                                      output=first.output, submitted_at_ms=int(time.time() * 1000),
                                      turns=[t.turn for t in turns])
            needs = first.needs
            for other in turns[1:]:
                needs |= other.needs
            description = f"{len(turns)} agent turn(s) of run {first.run}"
            worker = first.worker
            with self.conn.pipeline(transaction=False) as pipe:
                turn_queue.push(pipe, self.keys, worker, turn_queue.new_job(
                    job_id, payload.as_json(), needs.as_dict(), description,
                    timeout_s=TURN_JOB_TIMEOUT_S, retries=TURN_RETRIES))
                if worker is not None:
                    active_until = time.time() + ACTIVE_S
                    pipe.zadd(self.keys.homed_sessions(worker), {t.turn.session_id: active_until for t in turns})
                    for waiting in turns:
                        if waiting.home is not None and waiting.home != worker:
                            pipe.zrem(self.keys.homed_sessions(waiting.home), waiting.turn.session_id)
                pipe.execute()
            with self._ready:
                self._jobs[job_id] = (len(turns), time.monotonic())
                for waiting in turns:
                    self._job_of_turn[waiting.turn.turn_id] = job_id
        except BaseException as exc:
            for waiting in turns:  # written never
                self.router.written(waiting.worker, waiting.home)
                waiting.enqueued.set_exception(exc)
        else:
            for waiting in turns:  # written now
                self.router.written(waiting.worker, waiting.home)
                waiting.enqueued.set_result(None)
