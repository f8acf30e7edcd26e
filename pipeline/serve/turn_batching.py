"""Turns that reach a server together travel together: a flusher task on the server's loop enqueues
the turns waiting when it comes round as one job of turns (per run, output, worker class and target
worker).

While the server's jobs of turns in flight already keep the pool's live workers busy (two jobs each),
new turns wait for one of those to be answered (at most `HOLD_S`), so under load a job's cost
is paid once for many turns; a turn reaching an idle pool is enqueued at once. A job goes to its
chosen worker's turn queue (`pipeline.core.jobs.turn_queue`), or to the pool's shared lane for any
worker (the same kind of stream, read by them all), in one pipeline on the server's asyncio client
(in a thread where Redis has none: Sentinel, TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import anyio
import redis

from pipeline.core.jobs import turn_queue
from pipeline.serve.routing import ACTIVE_S, Router
from pipeline.submit.request_file import ParsedRequest
from schemas.capabilities import Needs
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.turn_job import TurnJob

TURN_JOB_TIMEOUT_S = 3600
TURN_RETRIES = 1
MAX_TURNS_PER_JOB = 64
HOLD_S = 0.05  # the longest a turn waits for others to share its job while the workers are busy
OUTSTANDING_S = 2.0  # a job of turns this server enqueued counts as in flight for at most this long


@dataclass
class WaitingTurn:
    """A turn handed to the flusher, and what became of it."""

    request: RolloutRequest | ParsedRequest  # the server's own: ids as an array (`ParsedRequest.of_array`)
    turn: TurnTag
    run: str
    output: str
    needs: Needs
    group: Hashable
    worker: str | None
    home: str | None
    enqueued: asyncio.Future[None] | None = None  # done once its job is enqueued (or failed to be)


class TurnBatcher:
    """Enqueues one server's turns of one pool as jobs, several turns a job under load."""

    def __init__(self, conn: redis.Redis, router: Router, *, async_conn: Callable[[], Any] = lambda: None,
                 max_turns_per_job: int = MAX_TURNS_PER_JOB) -> None:
        self.conn = conn
        self.router = router
        self.keys = router.keys
        self.async_conn = async_conn  # the server's asyncio client, or None
        self.max_turns_per_job = max_turns_per_job
        self._waiting: list[WaitingTurn] = []
        self._wake: asyncio.Event | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._jobs: dict[str, tuple[int, float]] = {}  # this server's jobs of turns: turns unanswered, enqueued at
        self._job_of_turn: dict[str, str] = {}

    async def enqueue(self, waiting: WaitingTurn) -> None:
        """Hand the turn to the flusher and return once its job is enqueued; raise what the enqueue raised."""
        if self._flusher is None or self._flusher.done() or self._flusher.get_loop() is not asyncio.get_running_loop():
            self._wake = asyncio.Event()
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(self._wake))
        waiting.enqueued = asyncio.get_running_loop().create_future()
        self._waiting.append(waiting)
        self._wake_flusher()
        await waiting.enqueued

    def _wake_flusher(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _flush_loop(self, wake: asyncio.Event) -> None:
        while True:
            while not self._waiting:
                wake.clear()
                await wake.wait()
            # Flow control: while this server's earlier jobs keep the pool's workers busy, turns
            # wait here (at most HOLD_S) and go on together; an idle pool gets each turn at once.
            held_until = time.monotonic() + HOLD_S
            while (len(self._waiting) < self.max_turns_per_job and self._busy()
                   and (left := held_until - time.monotonic()) > 0):
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), left)
            batch, self._waiting = self._waiting, []
            groups: dict[Hashable, list[WaitingTurn]] = {}
            for waiting in batch:
                groups.setdefault(waiting.group, []).append(waiting)
            for group in groups.values():
                for start in range(0, len(group), self.max_turns_per_job):
                    await self._enqueue_job(group[start:start + self.max_turns_per_job])

    def _busy(self) -> bool:
        """Whether this server's jobs of turns in flight are enough to keep the pool's live workers busy
        (two per worker: one running, one taken next); jobs older than `OUTSTANDING_S` no longer count."""
        now = time.monotonic()
        recent = sum(1 for _, enqueued in self._jobs.values() if now - enqueued < OUTSTANDING_S)
        return recent >= 2 * max(1, len(self.router.known_workers()))

    def answered(self, turn_id: str) -> None:
        """A turn this server enqueued is answered (or given up): its job counts down (on the loop)."""
        job_id = self._job_of_turn.pop(turn_id, None)
        if job_id is None or job_id not in self._jobs:
            return
        left, enqueued = self._jobs[job_id]
        if left <= 1:
            del self._jobs[job_id]
            self._wake_flusher()
        else:
            self._jobs[job_id] = (left - 1, enqueued)

    async def _enqueue_job(self, turns: list[WaitingTurn]) -> None:
        try:
            first = turns[0]
            job_id = f"turns-{uuid.uuid4().hex[:16]}"
            payload = JobPayload.pack([t.request for t in turns], run=first.run, job_id=job_id, batch_id=job_id,
                                      output=first.output, submitted_at_ms=int(time.time() * 1000),
                                      turns=[t.turn for t in turns])
            needs = first.needs
            for other in turns[1:]:
                needs |= other.needs
            job = turn_queue.new_job(job_id, payload.as_json(), needs.as_dict(),
                                     f"{len(turns)} agent turn(s) of run {first.run}",
                                     timeout_s=TURN_JOB_TIMEOUT_S, retries=TURN_RETRIES)
            aconn = self.async_conn()
            if aconn is not None:
                async with aconn.pipeline(transaction=False) as pipe:
                    self._push(pipe, job, turns)
                    await pipe.execute()
            else:
                await anyio.to_thread.run_sync(self._push_now, job, turns)
            self._jobs[job_id] = (len(turns), time.monotonic())
            for waiting in turns:
                self._job_of_turn[waiting.turn.turn_id] = job_id
        except asyncio.CancelledError:  # the server stops
            for waiting in turns:
                self.router.written(waiting.worker, waiting.home)
                if waiting.enqueued is not None:
                    waiting.enqueued.cancel()
            raise
        except Exception as exc:
            for waiting in turns:  # written never
                self.router.written(waiting.worker, waiting.home)
                if waiting.enqueued is not None and not waiting.enqueued.done():
                    waiting.enqueued.set_exception(exc)
        else:
            for waiting in turns:  # written now
                self.router.written(waiting.worker, waiting.home)
                if waiting.enqueued is not None and not waiting.enqueued.done():
                    waiting.enqueued.set_result(None)

    def _push_now(self, job: TurnJob, turns: list[WaitingTurn]) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            self._push(pipe, job, turns)
            pipe.execute()

    def _push(self, pipe: Any, job: TurnJob, turns: list[WaitingTurn]) -> None:
        """The job on its worker's turn queue (or the lane), and the sessions' homes, in `pipe`
        (a sync or an asyncio pipeline: the commands are only queued here)."""
        worker = turns[0].worker
        turn_queue.push(pipe, self.keys, worker, job)
        if worker is not None:
            active_until = time.time() + ACTIVE_S
            pipe.zadd(self.keys.homed_sessions(worker), {t.turn.session_id: active_until for t in turns})
            for waiting in turns:
                if waiting.home is not None and waiting.home != worker:
                    pipe.zrem(self.keys.homed_sessions(waiting.home), waiting.turn.session_id)
