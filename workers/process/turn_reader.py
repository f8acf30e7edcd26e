"""The worker's side of its turn queue and of the pool's shared lane (`pipeline.core.jobs.
turn_queue`): the turns routed to it, and those routed to any worker, read by a thread of their own
straight into the feeder as `workers.process.turn_work.TurnWork`.

`TurnReader` reads its worker's stream and the pool's lane as a consumer of the pool's workers'
group (one blocking XREADGROUP of both) while the worker is ready for turns (not paused, serving
the pool's weights, healthy, not stopping) and the engine has room for a turn. RQ's work loop goes
on taking the pool's batch queue meanwhile. A pause that arrives while the read blocks is seen after
it: the entry is handed back untouched. Each job is admitted first (`workers.jobs.admission.
admit_turn`, the worker's one check of what a job needs): one this worker cannot serve is moved to
a live worker that can, or handed back to wait for one.

Every `TAKE_OVER_S` the reader also takes what no live worker runs: the entries of dead workers'
streams (those a dead worker held, at once, and those no worker had yet), and entries of its own
stream and of the lane left idle past `turn_queue.CLAIM_AFTER_S` (their worker died, or a reply
was lost on the way; one handed back, at once); a dead worker's stream is forgotten once empty. A
keeper thread keeps the entries it runs fresh every `turn_queue.KEEP_EVERY_S`, however long the
reader blocks, and registers its queue again every `REGISTER_EVERY_S` (a queue forgotten while the
worker looked dead, in a partition, comes back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import redis

from pipeline.core.broker import keys
from pipeline.core.broker.work_streams import Claimed
from pipeline.core.jobs import turn_queue
from pipeline.core.jobs.turn_queue import TURNS
from schemas.turn_failure import TurnFailure
from schemas.turn_job import TurnJob
from schemas.worker_info import Capabilities
from workers.jobs import admission
from workers.jobs.feeder import Feeder
from workers.process.turn_work import TurnEnds, TurnWork, failure_of
from workers.runtime.periodic import Periodic

log = logging.getLogger(__name__)

BLOCK_S = 10.0  # the longest one read blocks (an idle worker's reads); pauses are checked after it
TAKE_OVER_S = 5.0  # how often the reader takes over what no live worker runs (3 commands an idle worker)
REGISTER_EVERY_S = 10.0
STOP_WAIT_S = 10.0  # how long stopping waits for the thread (its read is ended at once; Redis may be away)
NOT_READY_S = 0.2  # how often a worker not ready for turns looks again
REDIS_RETRY_S = 1.0


class TurnReader:
    """A thread admitting the entries of `worker_id`'s turn queue (and those it takes over) to
    `feeder` while `ready()`; a keeper thread keeping them fresh."""

    def __init__(self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, feeder: Feeder, ends: TurnEnds, *,
                 capabilities: Capabilities, ready: Callable[[], bool], block_s: float = BLOCK_S,
                 take_over_s: float = TAKE_OVER_S, claim_after_s: float = turn_queue.CLAIM_AFTER_S) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.feeder = feeder
        self.ends = ends
        self.capabilities = capabilities
        self.ready = ready
        self.block_s = block_s
        self.take_over_s = take_over_s
        self.claim_after_s = claim_after_s
        self.stream = pool.turn_queue(worker_id)
        self._pending: list[Claimed[TurnJob]] = []  # read in one go, waiting for room in the feeder
        self._next_take_over = 0.0
        self._next_own_claim = 0.0
        self._next_register = 0.0
        # The reads' own connection, so that `stop` can end a read at once (CLIENT UNBLOCK).
        self._reader = redis.Redis(connection_pool=conn.connection_pool, single_connection_client=True)
        self._reader_id: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="turn-reader", daemon=True)
        self._keeper = Periodic("turn-keeper", turn_queue.KEEP_EVERY_S, self.keep,
                                on_error=lambda exc: log.warning("turn queue upkeep failed: %s", exc))  # next round

    def start(self) -> None:
        turn_queue.register(self.conn, self.pool, self.worker_id)
        self._keeper.start()
        self._thread.start()

    def stop(self) -> None:
        """Read nothing more: a read under way ends at once; an entry being admitted still is."""
        self._stop.set()
        reader = self._reader_id
        if reader is not None:
            with contextlib.suppress(redis.RedisError):  # Redis gone: the read fails on its own
                self.conn.client_unblock(reader)
        self._thread.join(timeout=STOP_WAIT_S)

    def close(self) -> None:
        """Stop keeping the entries it runs (once the jobs in flight are done)."""
        self._keeper.stop()

    def held(self) -> list[Claimed[TurnJob]]:
        """The entries this worker runs, or has read and will run once the engine has room."""
        return [*(work.claimed for work in self.feeder.works() if isinstance(work, TurnWork)), *self._pending]

    def keep(self) -> None:
        """The entries it runs kept from a take-over; its queue registered again now and then."""
        if time.monotonic() >= self._next_register:
            self._next_register = time.monotonic() + REGISTER_EVERY_S
            self.conn.sadd(self.pool.turn_queue_owners, self.worker_id)
        turn_queue.keep(self.conn, self.worker_id, self.held())

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.ready():
                    self._stop.wait(NOT_READY_S)
                    continue
                self.feeder.wait_for_room(self._stop.is_set)
                if self._reader_id is None:
                    self._reader_id = self._reader.client_id()
                if self._stop.is_set():  # asked before its id was known: no read to end
                    break
                if time.monotonic() >= self._next_take_over:
                    self._next_take_over = time.monotonic() + self.take_over_s
                    taken = self.take_over()
                    if taken:
                        self._admit_all(taken, taken_over=True)
                        continue
                block_ms = max(1, int(self._block_s() * 1000))
                read = self._read(block_ms)
                self._admit_all(read, taken_over=False)
            except redis.RedisError as exc:
                self._reader_id = None  # a new connection, a new id
                if self._stop.is_set():
                    break
                log.warning("worker %s: its turn queue is unreachable (%s); trying again", self.worker_id, exc)
                self._stop.wait(REDIS_RETRY_S)
            except Exception:  # never let the reader stop for one bad entry
                log.exception("worker %s: reading its turn queue failed", self.worker_id)
                self._stop.wait(REDIS_RETRY_S)
        with contextlib.suppress(redis.RedisError):
            self._reader.close()

    def _read(self, block_ms: int) -> list[Claimed[TurnJob]]:
        """An entry of its own stream, of the pool's lane, or one of each (one read of both)."""
        try:
            return TURNS.read_one_each(self._reader, [self.stream, self.pool.lane], self.worker_id, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            turn_queue.register(self.conn, self.pool, self.worker_id)  # forgotten while it looked dead
            return []

    def take_over(self) -> list[Claimed[TurnJob]]:
        """What no live worker runs, now this worker's: the entries of dead workers' streams (those
        dead workers held, and those no worker had yet), and, every `claim_after_s`, entries of its
        own stream and of the pool's lane left idle that long (handed back, held by a worker that
        died, or read by a reply that was lost); dead workers' empty streams forgotten."""
        live, dead = turn_queue.owners(self.conn, self.pool, self.worker_id)
        room = max(1, self.feeder.max_jobs_in_flight - self.feeder.in_flight)
        taken: list[Claimed[TurnJob]] = []
        if time.monotonic() >= self._next_own_claim:
            self._next_own_claim = time.monotonic() + self.claim_after_s
            held = {claimed.entry_id for claimed in self.held()}
            # Entries this worker runs already (its keeper was late) are not run twice.
            for stream in (self.stream, self.pool.lane):
                if len(taken) < room:
                    taken += [claimed for claimed in TURNS.take_over(self.conn, stream, self.worker_id,
                                                                     int(self.claim_after_s * 1000), room - len(taken))
                              if claimed.entry_id not in held]
        for worker in dead:
            stream = self.pool.turn_queue(worker)
            try:
                if len(taken) < room:
                    taken += TURNS.take_over_from(self.conn, stream, self.worker_id, lambda c: c not in live,
                                                  room - len(taken))
                if len(taken) < room:
                    taken += TURNS.read_new(self.conn, [stream], self.worker_id, room - len(taken), None)
            except redis.ResponseError:  # made anew by a late push, without its group: give it one
                TURNS.ensure_group(self.conn, stream)
                continue
            if turn_queue.forget_if_empty(self.conn, self.pool, worker):
                log.info("worker %s: dead worker %s's turn queue is empty and forgotten", self.worker_id, worker)
        if taken:
            log.warning("worker %s took over %d turn job(s) no live worker ran", self.worker_id, len(taken))
        return taken

    def hand_back(self, claimed: Claimed[TurnJob]) -> None:
        """Give an entry back unrun: this worker's next take-over (or a live one's, once it is dead) runs it."""
        turn_queue.hand_back(self.conn, self.worker_id, claimed)
        self._next_own_claim = 0.0

    def _block_s(self) -> float:
        """How long a read blocks: until the next take-over, and half the read timeout of the connection
        it reads on at most, so that a reply read late by a busy worker process is no TimeoutError.

        The reading connection's own timeout, not its pool's: RQ raises the pool's (to 11 s with a 1 s
        maintenance interval, 20 s by default) after some connections were made with the client's, and
        the reader may hold one of those (a 5 s timeout under a 4.999 s block failed now and then)."""
        block = min(self.block_s, max(0.001, self._next_take_over - time.monotonic()))
        connection = self._reader.connection
        read_timeout = connection.socket_timeout if connection is not None else \
            self.conn.connection_pool.connection_kwargs.get("socket_timeout")
        return block if not read_timeout else max(0.001, min(block, read_timeout / 2))

    def _admit_all(self, entries: list[Claimed[TurnJob]], *, taken_over: bool) -> None:
        self._pending = list(entries)
        try:
            for position, claimed in enumerate(entries):
                if position:
                    self.feeder.wait_for_room(self._stop.is_set)
                if self._stop.is_set() or not self.ready():  # paused (or stopping) while the read blocked
                    for unrun in entries[position:]:
                        self.hand_back(unrun)
                    return
                self._admit(claimed, taken_over=taken_over)
                self._pending = list(entries[position + 1:])
        finally:
            self._pending = []

    def _admit(self, claimed: Claimed[TurnJob], *, taken_over: bool) -> None:
        """Into the feeder, if this worker can serve it (`admission.admit_turn`); else moved to a worker
        that can, handed back to wait for one, or failed."""
        job = claimed.job
        try:
            verdict = admission.admit_turn(self.conn, job, self.worker_id, self.capabilities, self.pool.name)
            if verdict.action == "move" and verdict.to is not None:
                turn_queue.move(self.conn, self.pool, claimed, verdict.to)
                log.info("worker %s: turn job %s moved to worker %s (%s)", self.worker_id, job.job_id, verdict.to,
                         verdict.reason)
            elif verdict.action == "hand_back":
                turn_queue.hand_back(self.conn, self.worker_id, claimed)
                log.warning("worker %s: turn job %s waits for a worker that can serve it: %s", self.worker_id,
                            job.job_id, verdict.reason)
            elif verdict.action == "fail":
                turn_queue.fail(self.conn, claimed, TurnFailure("unservable", verdict.reason))
                log.error("worker %s: turn job %s failed: %s", self.worker_id, job.job_id, verdict.reason)
            else:
                self.feeder.admit(TurnWork(claimed, self.ends, taken_over=taken_over))
        except redis.RedisError:
            raise  # the reader's loop tries again; the entry is taken back by a claim
        except Exception as exc:  # before it was in flight: nothing else would end it
            turn_queue.fail(self.conn, claimed, failure_of(exc))
            log.exception("worker %s: turn job %s not admitted", self.worker_id, job.job_id)
