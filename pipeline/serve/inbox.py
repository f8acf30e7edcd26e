"""A server's inbox: its turns' answers, taken in batches by one thread and handed to their waiters.

Workers push each answer (the turn id, then its rows or an error) to the inbox of the server that
enqueued the turn (`pipeline.core.jobs.replies`), one push for all the turns of a job. One thread
of the server takes them: a BLPOP, whose answer goes to its waiter at once, then whatever else waits
there in one LPOP, so under load a turn costs the server a fraction of a command while it waits, and
no socket of its own, and a lone turn waits on no round trip after its answer comes (Redis on
another host: benchmarks/across_hosts.py). A waiter asks for
its turn's answer (`expect`) and gets a future; an answer that comes before its waiter asks (a fast
worker) is kept for `UNCLAIMED_S`; one nobody asks for in that time (its waiter gave up) is dropped,
its rows still in the turn log, where a later call finds them (`turn_wait.TurnWaiter`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import replies

log = logging.getLogger(__name__)

BLOCK_S = 1.0  # one take blocks at most this long, then looks whether the inbox is closed
TAKE_AT_ONCE = 256  # answers taken with one LPOP after a BLPOP
UNCLAIMED_S = 60.0  # how long an answer no waiter asked for yet is kept
MAX_UNCLAIMED = 4096
REDIS_RETRY_S = 1.0


class Inbox:
    """One server's inbox, and the futures of the turns it waits for."""

    def __init__(self, conn: redis.Redis, server_id: str | None = None) -> None:
        self.conn = conn
        self.server_id = server_id or uuid.uuid4().hex[:16]
        self.key = keys.serve_inbox(self.server_id)
        self._lock = threading.Lock()
        self._waiting: dict[str, list[Future[bytes]]] = {}
        self._unclaimed: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def expect(self, turn_id: str) -> Future[bytes]:
        """A future of the turn's answer (rows as Arrow IPC, or an encoded `TurnFailure`); `forget` it after."""
        future: Future[bytes] = Future()
        with self._lock:
            kept = self._unclaimed.pop(turn_id, None)
            if kept is not None:
                future.set_result(kept[1])
                return future
            self._waiting.setdefault(turn_id, []).append(future)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._take_loop, name=f"inbox-{self.server_id}", daemon=True)
                self._thread.start()
        return future

    def forget(self, turn_id: str, future: Future[bytes]) -> None:
        """The waiter of `future` no longer waits."""
        with self._lock:
            futures = self._waiting.get(turn_id)
            if futures is not None and future in futures:
                futures.remove(future)
                if not futures:
                    del self._waiting[turn_id]

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BLOCK_S + 1)

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
                if not unreachable:  # once an outage
                    log.warning("server %s: its inbox is unreachable (%s); waiters look at the turn log meanwhile",
                                self.server_id, exc)
                unreachable = True
                self._closed.wait(REDIS_RETRY_S)
                continue
            unreachable = False

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
            with contextlib.suppress(InvalidStateError):  # its waiter gave up (cancelled) meanwhile
                future.set_result(answer)
