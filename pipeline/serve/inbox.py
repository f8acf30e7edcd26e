"""A server's inbox: its turns' answers, taken in batches and handed to their waiters.

Workers push each answer (the turn id, then its rows or an error) to the inbox of the server that
enqueued the turn (`pipeline.core.jobs.replies`), one push for all the turns of a job. The server
takes them with a BLPOP, whose answer goes to its waiter at once, then whatever else waits there in
one LPOP, so under load a turn costs the server a fraction of a command while it waits, and no
socket of its own, and a lone turn waits on no round trip after its answer comes (Redis on another
host: benchmarks/across_hosts.py). The taker is a task on the server's event loop over its asyncio
client, so an answer reaches its waiter with no thread in between; where this Redis has no asyncio
client (Sentinel, TLS: `asyncio_twin`) it is a thread. A waiter asks for its turn's answer
(`expect`) and gets a future; an answer that comes before its waiter asks (a fast worker) is kept for
`UNCLAIMED_S`; one nobody asks for in that time (its waiter gave up) is dropped, its rows still in the
turn log, where a later call finds them (`turn_wait.TurnWaiter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import replies

log = logging.getLogger(__name__)

BLOCK_S = 1.0  # one take blocks at most this long, then looks whether the inbox is closed
TAKE_AT_ONCE = 256  # answers taken with one LPOP after a BLPOP
UNCLAIMED_S = 60.0  # how long an answer no waiter asked for yet is kept
MAX_UNCLAIMED = 4096
REDIS_RETRY_S = 1.0
AnswerFuture = Future[bytes] | asyncio.Future[bytes]  # a thread's taker's, or the loop's


class Inbox:
    """One server's inbox, and the futures of the turns it waits for."""

    def __init__(self, conn: redis.Redis, server_id: str | None = None, *,
                 async_conn: Callable[[], Any] = lambda: None) -> None:
        self.conn = conn
        self.server_id = server_id or uuid.uuid4().hex[:16]
        self.key = keys.serve_inbox(self.server_id)
        self._async_conn = async_conn  # the server's asyncio client, or None (then the taker is a thread)
        self._lock = threading.Lock()
        self._waiting: dict[str, list[AnswerFuture]] = {}
        self._unclaimed: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._closed = threading.Event()
        self._taker: threading.Thread | asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the taker's, when it is a task

    def expect(self, turn_id: str) -> AnswerFuture:
        """A future of the turn's answer (rows as Arrow IPC, or an encoded `TurnFailure`); `forget` it
        after. Taken on the server's loop (asked there, with an asyncio client): an asyncio future."""
        with self._lock:
            if self._taker is None and not self._closed.is_set():
                self._start()
            future: AnswerFuture = Future() if self._loop is None else self._loop.create_future()
            kept = self._unclaimed.pop(turn_id, None)
            if kept is not None:
                future.set_result(kept[1])
            else:
                self._waiting.setdefault(turn_id, []).append(future)
        return future

    def _start(self) -> None:
        aconn = self._async_conn()
        if aconn is not None:
            self._loop = asyncio.get_running_loop()
            self._taker = self._loop.create_task(self._take_async(aconn), name=f"inbox-{self.server_id}")
        else:
            self._taker = threading.Thread(target=self._take_loop, name=f"inbox-{self.server_id}", daemon=True)
            self._taker.start()

    def forget(self, turn_id: str, future: AnswerFuture) -> None:
        """The waiter of `future` no longer waits."""
        with self._lock:
            futures = self._waiting.get(turn_id)
            if futures is not None and future in futures:
                futures.remove(future)
                if not futures:
                    del self._waiting[turn_id]

    def close(self) -> None:
        """Stop taking answers: the thread ends within a block; the task with its loop (or within a block)."""
        self._closed.set()
        if isinstance(self._taker, threading.Thread):
            self._taker.join(timeout=2 * BLOCK_S + 1)

    def _take_loop(self) -> None:
        unreachable = False
        while not self._closed.is_set():
            try:
                popped = self.conn.blpop([self.key], timeout=BLOCK_S)
                if popped is not None:
                    # The first answer goes to its waiter now, not a round trip later with the rest.
                    self._deliver(popped[1])
                    for raw in self.conn.lpop(self.key, TAKE_AT_ONCE) or []:
                        self._deliver(raw)
            except redis.RedisError as exc:
                unreachable = self._unreachable(unreachable, exc)
                self._closed.wait(REDIS_RETRY_S)
                continue
            unreachable = False

    async def _take_async(self, aconn: Any) -> None:
        """`_take_loop` on the server's loop, over its asyncio client."""
        unreachable = False
        while not self._closed.is_set():
            try:
                popped = await aconn.blpop([self.key], timeout=BLOCK_S)
                if popped is not None:
                    self._deliver(popped[1])
                    for raw in await aconn.lpop(self.key, TAKE_AT_ONCE) or []:
                        self._deliver(raw)
            except redis.RedisError as exc:
                unreachable = self._unreachable(unreachable, exc)
                await asyncio.sleep(REDIS_RETRY_S)
                continue
            unreachable = False

    def _unreachable(self, already: bool, exc: redis.RedisError) -> bool:
        if not already:  # once an outage
            log.warning("server %s: its inbox is unreachable (%s); waiters look at the turn log meanwhile",
                        self.server_id, exc)
        return True

    def _deliver(self, raw: bytes) -> None:
        try:
            turn_id, answer = replies.parse(raw)
        except ValueError:
            log.error("server %s: dropped an entry of its inbox that is not an answer: %.100r", self.server_id, raw)
            return
        now = time.monotonic()
        with self._lock:
            futures = self._waiting.pop(turn_id, None)
            if not futures:
                self._unclaimed[turn_id] = (now, answer)
                while self._unclaimed and (len(self._unclaimed) > MAX_UNCLAIMED
                                           or next(iter(self._unclaimed.values()))[0] < now - UNCLAIMED_S):
                    self._unclaimed.popitem(last=False)
                return
        for future in futures:
            # its waiter gave up (cancelled) meanwhile
            with contextlib.suppress(InvalidStateError, asyncio.InvalidStateError):
                future.set_result(answer)
