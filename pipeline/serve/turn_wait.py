"""Waiting for a turn's answer: the server's inbox hands it over (`pipeline.serve.inbox`); between
blocks the waiter looks elsewhere.

Between blocks a waiter looks for the answer another server's waiter recorded, the rows in the turn
log or the shard they were flushed to (the answer went to another server, or a waiter that is
gone), and a failed job. A turn whose worker was killed runs again on a live worker, which takes
it from the dead worker's turn queue (`pipeline.core.jobs.turn_queue`). Past the turn timeout it
says 503 (`Retry-After`) when no live worker of the pool could take the turn or the pool is
paused, else 504. The job stays queued: the agent's retry of
the same call waits for it again instead of generating it twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc
import redis
import redis.asyncio

from pipeline.core.broker import control_channel, keys
from pipeline.core.broker.connection import asyncio_twin
from pipeline.core.errors import PipelineError
from pipeline.core.jobs import turn_log, turn_queue, turn_stream
from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.serve.api_error import APIError
from pipeline.serve.inbox import Inbox
from pipeline.serve.routing import Router
from schemas.shard import rows_from_ipc
from schemas.turn_failure import TurnFailure
from schemas.turn_id import TurnId

DEFAULT_TURN_TIMEOUT_S = 600.0
ASYNC_CONNECTIONS = 4096  # streamed calls reading their tokens at once, a socket each
BLOCK_S = 1.0  # how long one wait blocks before checking the job's state
Answered = pa.Table | dict[str, Any]  # a turn's rows, or its answer recorded by another waiter


def _rows(reply: bytes) -> pa.Table:
    """An answer from the inbox: the turn's rows, or `APIError` when its worker failed it (`turn_queue.fail`)."""
    failure = TurnFailure.decode(reply)
    if failure is not None:
        raise _failed(failure)
    return rows_from_ipc(reply)


# A failed turn's HTTP status by its code: no worker can serve the call (its fault), or the worker failed.
FAILURE_STATUS = {"unservable": 400, "failed": 500}


def _failed(failure: TurnFailure) -> APIError:
    return APIError(FAILURE_STATUS[failure.code], f"the turn failed on the worker: {failure.reason}",
                    code="turn_failed")


class TurnWaiter:
    """Waits for one pool's turns on behalf of a server."""

    def __init__(self, conn: redis.Redis, router: Router, inbox: Inbox, answered: Callable[[str], None], *,
                 turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S) -> None:
        self.conn = conn
        self.router = router
        self.inbox = inbox
        self.keys = router.keys
        self.turn_timeout_s = turn_timeout_s
        self._answered = answered  # the turn is answered or given up: its job counts down
        self._aconn: redis.asyncio.Redis | bool | None = False  # made on first use, in the server's loop
        self._read_threads: anyio.CapacityLimiter | None = None

    def job_of(self, turn_id: str) -> tuple[str | None, str | None]:
        """The turn's job id, and the worker whose turn queue holds it (None: the pool's shared lane)."""
        return turn_queue.parse_turn_job(self.conn.get(keys.turn_job(turn_id)))

    async def wait_async(self, turn_id: str, run: str, started: float,
                         settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        """The turn's rows, once its worker answers (the inbox hands them over: no thread and no
        socket while the turn is generated); or the answer `settled()` finds recorded (another
        server's waiter took the rows and recorded the turn); `APIError` for a failed or late turn.
        The checks between blocks run in a thread."""
        answer = self.inbox.expect(turn_id)
        waiting = asyncio.wrap_future(answer)
        try:
            while True:
                left = self.turn_timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise await anyio.to_thread.run_sync(self._late, turn_id)
                done, _ = await asyncio.wait([waiting], timeout=min(BLOCK_S, left))
                if done:
                    return _rows(waiting.result())
                found = await anyio.to_thread.run_sync(self._between_blocks, turn_id, run, settled)
                if found is not None:
                    return found
        finally:
            self.inbox.forget(turn_id, answer)
            waiting.cancel()
            self._answered(turn_id)

    async def stream_async(self, turn_id: str, run: str, started: float,
                           settled: Callable[[], dict[str, Any] | None]) -> AsyncIterator[list[TokenDelta] | Answered]:
        """A streamed turn: batches of its tokens as its worker publishes them (`pipeline.core.jobs.
        turn_stream`), then, last, what `wait_async` returns. The token stream is read from its start and
        not consumed; the rows come from the inbox (pushed before the stream's end entry), with the
        same checks as `wait_async` whenever a block passes without an entry. Where this Redis has no
        asyncio twin (Sentinel, TLS), each read blocks a thread instead."""
        aconn = self.async_conn()

        async def xread(*args: Any, **kwargs: Any) -> Any:
            if aconn is not None:
                return await aconn.xread(*args, **kwargs)
            return await anyio.to_thread.run_sync(partial(self.conn.xread, *args, **kwargs),
                                                  limiter=self._threads())

        answer = self.inbox.expect(turn_id)
        waiting = asyncio.wrap_future(answer)
        try:
            stream, last = keys.turn_stream(turn_id), b"0-0"
            while True:
                left = self.turn_timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise await anyio.to_thread.run_sync(self._late, turn_id)
                read = await xread({stream: last}, block=max(10, int(min(BLOCK_S, left) * 1000)))
                deltas, ended = [], False
                for _, entries in read or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        delta = turn_stream.parse(turn_id, fields)
                        if delta is None:
                            ended = True
                        else:
                            deltas.append(delta)
                if deltas:
                    yield deltas
                if ended or not read:  # every token read (or none came): the rows, else the checks
                    if ended:  # the rows were pushed before the end entry: the inbox hands them over now
                        await asyncio.wait([waiting], timeout=min(BLOCK_S, max(0.0, left)))
                    if waiting.done():
                        yield _rows(waiting.result())
                        return
                    found = await anyio.to_thread.run_sync(self._between_blocks, turn_id, run, settled)
                    if found is not None:
                        yield found
                        return
        finally:
            self.inbox.forget(turn_id, answer)
            waiting.cancel()
            self._answered(turn_id)

    def _between_blocks(self, turn_id: str, run: str,
                        settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any] | None:
        """After a block without an answer: the answer recorded by another waiter, the rows from the
        turn log (the answer went to another server's inbox, or a waiter that is gone), None to wait
        on, or `APIError`."""
        answered = settled()
        if answered is not None:
            return answered
        job_id, worker = self.job_of(turn_id)
        if job_id is None:  # a failover or restart lost the job with its key: the call's retry runs it again
            raise _failed(TurnFailure("failed", "its job is gone from Redis (a Redis failover or restart loses "
                                                "the latest writes); call again to run it"))
        failure = turn_queue.turn_failure(self.conn, turn_id)
        if failure is not None:
            raise _failed(failure)
        logged = self._logged(run, turn_id)  # answered, but the answer went to another server or a waiter gone
        if logged is None and worker is not None and worker not in {w.worker_id for w in self.router.live_workers()}:
            # Routed to a worker that died before the push (its queue already emptied and forgotten):
            # known again, so that the live workers read it.
            turn_queue.register(self.conn, self.keys, worker)
        return logged

    def _threads(self) -> anyio.CapacityLimiter:
        """Threads for stream reads on a Redis without an asyncio twin, as many as the sockets of one with it."""
        if self._read_threads is None:
            self._read_threads = anyio.CapacityLimiter(ASYNC_CONNECTIONS)
        return self._read_threads

    def async_conn(self) -> redis.asyncio.Redis | None:
        """An asyncio client to this server's Redis, made once, in the server's loop; None where Redis is
        reached through Sentinel or TLS (`asyncio_twin`)."""
        if self._aconn is False:
            self._aconn = asyncio_twin(self.conn, max_connections=ASYNC_CONNECTIONS)
        return self._aconn or None

    def _logged(self, run: str, turn_id: str) -> pa.Table | None:
        """A turn's rows from the run's turn log, or from the shard it was flushed to (its answer went
        to another server's inbox, or to a waiter that is gone)."""
        logged = turn_log.logged_turn(self.conn, run, turn_id)
        if logged is not None:
            return logged
        url = self.conn.get(keys.turn_shard(turn_id))
        if url is None:
            return None
        from pipeline.core.shards import read_rollouts

        parsed = TurnId.parse(turn_id)
        rows = read_rollouts(url.decode(), filter=(pc.field("session_id") == parsed.session_id)
                             & (pc.field("turn") == parsed.turn))
        return rows if rows.num_rows else None

    def _late(self, turn_id: str) -> APIError:
        job_id, _ = self.job_of(turn_id)
        try:
            paused = control_channel.read_state(self.conn, self.keys.name).paused
        except PipelineError:
            paused = False
        if paused or not self.router.live_workers():
            why = f"pool {self.keys.name!r} is paused" if paused else f"no live worker serves pool {self.keys.name!r}"
            retry_after = max(1, int(self.turn_timeout_s // 4))
            return APIError(503, f"{why}; the turn is queued and runs once a worker takes it: call again to get its "
                                 "answer", code="no_worker", headers={"Retry-After": str(retry_after)})
        status = "queued" if job_id is not None else "gone"
        return APIError(504, f"the turn did not finish within {self.turn_timeout_s:g} s (its job is "
                             f"{status}); call again to wait for it", code="turn_timeout")
