"""Running jobs on an engine, one shard per job, keeping a concurrent engine fed across job boundaries.

Every job a worker runs goes through its `Feeder`, as a `workers.jobs.work.Work`: an RQ job of a
trainer's batch, or a job of agent turns from the worker's turn queue, each with its own records.
RQ's work loop runs one job at a time; the worker's `execute_job` hands each job to the feeder,
which starts its records, validates the payload, submits the requests to the engine
(`workers.engines.base.ConcurrentEngine`) and returns as soon as the engine has room for more, so
the loop dequeues the next job while the last long sequences of this one still run. A completion
thread then finishes each job on its own: rows, shard and commit
(`workers.jobs.batch_job.commit_batch`), and the job's end (`Work.finish`: for an RQ job, RQ's
success or failure handling, retries included, exactly as `perform_job` would). An engine with
only `generate()` (the fake, in-process SGLang, or any engine with `--no-feed`) is fed through
`workers.engines.serial.SerialEngine`, one job at a time (`max_jobs_in_flight=1`).

The feeder owns its state: the jobs in flight and the `Gate`. It talks to its worker through one
callback, `jobs_changed`, called whenever a job enters or leaves the jobs in flight.

The `Gate` keeps weight loads apart from batches: a load waits until every job in flight has
finished (drain) and no job starts while one waits or runs.

A partial swap (`Feeder.partial_swap`, on an engine with `interrupt()`) keeps new jobs out but
does not wait: it stops every sample in flight at its next step, loads, and submits each
unfinished sample again as a continuation on the new weights (`workers.rows.continuation`); a job's
shard is still written once, when every one of its samples has finished.

Checkpoints (`workers.jobs.checkpoint`, on an interruptible engine, unless `checkpoint_every_s` is
0): the completion thread saves what each job's samples generated since the last checkpoint every
`checkpoint_every_s` (from the engine's `progress()` snapshot; an engine without it is
checkpointed only at partial swaps) and at every partial swap; a job's admission takes back its
checkpoint, if an earlier run of it left one, and continues its samples from there. The checkpoint
is deleted once the job commits.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_mod
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from rq.timeouts import JobTimeoutException

from pipeline.core.jobs import turn_stream
from pipeline.core.jobs.status import canceled_jobs
from workers.engines.base import ConcurrentEngine, is_checkpointable, is_interruptible
from workers.errors import JobCanceledError, UnsupportedRequestError
from workers.jobs import context
from workers.jobs.adapters import job_adapters, pin_stored, repin
from workers.jobs.batch_job import PreparedBatch, commit_batch, prepare_batch
from workers.jobs.checkpoint import DEFAULT_CHECKPOINT_EVERY_S, CheckpointStore, writer_id
from workers.jobs.turn_streams import TurnStreams
from workers.jobs.work import ExcInfo, Work
from workers.rows.continuation import Progress, Submission
from workers.runtime import logs

log = logging.getLogger(__name__)

DEFAULT_MAX_JOBS_IN_FLIGHT = 64
# Batches a worker feeds an engine that runs one batch at a time (`batches_waiting()`, the hf engine)
# beyond the running one: its next job is in the engine when the running one ends, and the run's
# other jobs stay queued for other workers.
PREFETCH_BATCHES = 1
WAKE = "wake"


class Gate:
    """Jobs in flight against exclusive engine operations (weight loads); exclusive ones win."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs = 0
        self._exclusive = 0  # waiting for or holding exclusive use

    @property
    def jobs(self) -> int:
        return self._jobs

    def enter(self) -> None:
        """A job starts; blocks while a weight load waits or runs."""
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._jobs += 1

    def leave(self) -> None:
        with self._cond:
            self._jobs -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, *, drain: bool = True) -> Iterator[None]:
        """Keep new jobs out until done; with `drain`, first wait until no job is in flight."""
        with self._cond:
            self._exclusive += 1
            while drain and self._jobs:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive -= 1
                self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._jobs == 0, timeout)


@dataclass(eq=False)
class FedJob:
    """A job the feeder has taken: its work, its prepared batch and progress on the engine, its
    deadline, checkpoint and streamed turns."""

    work: Work
    timeout_s: int = 0
    batch: PreparedBatch | None = None
    progress: Progress | None = None
    submission: Submission | None = None
    future: Any = None
    deadline: float = float("inf")
    timed_out: bool = False
    canceled: bool = False
    samples: int = 0
    submitted: float = field(default_factory=time.monotonic)
    writer: int = 0  # this execution's tag in the job's checkpoint (and its streamed turns' attempt)
    streams: TurnStreams | None = None  # the job's turns whose tokens are published as they come
    checkpointed: bool = False  # the job has a checkpoint in Redis (to delete at its commit)


@dataclass
class CheckpointStats:
    """What this worker's checkpoints wrote (for benchmarks and metrics)."""

    saves: int = 0  # round trips of saves
    commands: int = 0  # every checkpoint command: RPUSH + EXPIRE per job saved, LRANGE per job admitted, DEL
    pieces: int = 0
    tokens: int = 0
    bytes: int = 0
    resumed_samples: int = 0
    resumed_tokens: int = 0


class Feeder:
    """Jobs in flight on one concurrent engine (up to `max_jobs_in_flight`), each ended by its `Work`.

    `jobs_changed(work)` is called after `work` entered the jobs in flight, `jobs_changed(None)`
    after one left them (`works()` lists them, oldest first)."""

    def __init__(
        self, engine: ConcurrentEngine, *, connection: redis.Redis, worker_id: str,
        jobs_changed: Callable[[Work | None], None] = lambda _: None,
        max_jobs_in_flight: int = DEFAULT_MAX_JOBS_IN_FLIGHT, headroom: int | None = None,
        checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S, turn_reserve: int | None = None,
    ) -> None:
        self.engine = engine
        self.connection = connection
        self.worker_id = worker_id
        self.jobs_changed = jobs_changed
        self.gate = Gate()
        self.max_jobs_in_flight = max(1, max_jobs_in_flight)
        # Sequences fed beyond the capacity, so a freed slot never waits for a Redis round trip.
        self.headroom = engine.capacity // 8 if headroom is None else headroom
        # Slots (and one job) batch jobs leave free while the pool serves agent turns (`has_room`).
        self.turn_reserve = max(1, engine.capacity // 8) if turn_reserve is None else turn_reserve
        self.turns_active: Callable[[], bool] = lambda: False
        self._batch_job_samples = 0  # the last batch job's sequences: what the next one likely adds
        # Jobs whose batch resolved; None: stop; WAKE: a streamed turn was admitted (stream at once).
        self._done: queue_mod.Queue[FedJob | str | None] = queue_mod.Queue()
        self._entries: dict[str, FedJob] = {}
        self._cond = threading.Condition()
        # Every engine submission holds this; a partial swap holds it from the interrupt until the
        # continuations are submitted, so nothing reaches the engine while its weights change.
        self._submit_lock = threading.RLock()
        self._swapping = False
        self._parked: list[FedJob] = []  # jobs stopped by the swap under way, to continue after it
        self.can_interrupt = is_interruptible(engine)
        self.checkpoint_every_s = checkpoint_every_s
        self.checkpoints = CheckpointStore(connection) if checkpoint_every_s > 0 and self.can_interrupt else None
        self.can_snapshot = is_checkpointable(engine)
        # Streamed turns get their tokens as they come from an engine that reports its batches'
        # progress; from any other, whole at their end.
        self.can_stream = callable(getattr(engine, "progress", None))
        self._next_stream = 0.0
        self.checkpoint_stats = CheckpointStats()
        self._next_checkpoint = time.monotonic() + checkpoint_every_s
        self._thread: threading.Thread | None = None
        self.admitted: list[tuple[float, str]] = []  # (monotonic time, job id), for tests and benchmarks

    @property
    def in_flight(self) -> int:
        return len(self._entries)

    def works(self) -> list[Work]:
        """The jobs in flight, oldest first."""
        return [e.work for e in list(self._entries.values())]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._complete_loop, name="feeder-commit", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._done.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def has_room(self, batch: bool = False) -> bool:
        """Whether the engine can take another job: an agent turn's while its load is under capacity +
        headroom (on an engine that runs one batch at a time, while at most `PREFETCH_BATCHES - 1`
        wait for the running one); a batch job's, while the pool serves agent turns (`turns_active`), only while it
        leaves `turn_reserve` slots and one job free, so that a turn never waits behind a batch run
        for a slot (the engine's queue is first come, first served)."""
        jobs, limit = self.max_jobs_in_flight, self.engine.capacity + self.headroom
        if batch and self.turns_active():  # the next batch job's sequences too must leave the reserve free
            jobs = max(1, jobs - 1)
            limit = max(1, self.engine.capacity - self.turn_reserve - self._batch_job_samples + 1)
        return len(self._entries) < jobs and self.engine.load() < limit and self._waiting() < PREFETCH_BATCHES

    def _waiting(self) -> int:
        """Batches waiting in the engine for the running one (0 for an engine that runs them together)."""
        waiting = getattr(self.engine, "batches_waiting", None)
        return waiting() if callable(waiting) else 0

    def wait_for_room(self, stop: Callable[[], bool], batch: bool = False) -> None:
        """Return once the engine can take more (a batch job, if `batch`), or a stop is requested."""
        with self._cond:
            while not self.has_room(batch) and not stop():
                self._cond.wait(0.005)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job in flight has finished (shard committed or failed)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._entries, timeout)

    def abort_all(self) -> None:
        """Cold shutdown: cancel every batch in the engine; each job then fails (or is handed back)."""
        for entry in list(self._entries.values()):
            if entry.future is not None:
                entry.future.cancel()

    def abort_canceled(self) -> int:
        """Abort the jobs in flight that were canceled (`pipeline.runs.cancel`) at the engine's next step;
        each then ends with `JobCanceledError` (no shard, no commit). Returns how many."""
        entries = [e for e in list(self._entries.values()) if e.batch is not None and not e.canceled]
        by_run: dict[str, list[FedJob]] = {}
        for entry in entries:
            assert entry.batch is not None
            by_run.setdefault(entry.batch.job.run, []).append(entry)
        aborted = 0
        for run, in_run in by_run.items():
            canceled = canceled_jobs(self.connection, run, [e.work.id for e in in_run])
            for entry in in_run:
                if entry.work.id in canceled:
                    entry.canceled = True
                    aborted += 1
                    if entry.future is not None:
                        entry.future.cancel()
        return aborted

    # -- admission (the work loop's thread) -------------------------------------------------

    def admit(self, work: Work) -> None:
        """Start `work` on the engine; failures before the engine runs it are finalised here."""
        with logs.job_scope(work.id, work.payload, self.worker_id):
            self._admit(work)

    def _admit(self, work: Work) -> None:
        self.gate.enter()
        try:
            work.open()
        except BaseException:
            self.gate.leave()
            raise
        entry = FedJob(work)
        with self._cond:
            self._entries[work.id] = entry
        self.jobs_changed(work)
        try:
            payload, entry.timeout_s = work.start()
            if entry.timeout_s and entry.timeout_s > 0:
                entry.deadline = time.monotonic() + entry.timeout_s
            batch = prepare_batch(payload, self.connection)
            entry.batch = batch
            entry.samples = sum(r.sampling_params.n for r in batch.requests)
            if batch.job.turns is None:
                self._batch_job_samples = entry.samples
            progress = entry.progress = Progress(batch.requests, max_staleness=batch.job.max_staleness)
            entry.writer = writer_id(uuid.uuid4().hex)
            if self.can_stream:
                entry.streams = TurnStreams.of(batch.requests, batch.job.turns, entry.writer)
                if entry.streams is not None:
                    self._done.put(WAKE)
            restored = self._restore(entry)
            with self._submit_lock:
                # The version the job starts on: a partial swap may have loaded one since `prepare_batch`.
                batch.weight_version = version = self.engine.weight_version
                self._submit(entry, progress.resume(version, untouched_whole=True) if restored
                             else progress.first(version))
            self.admitted.append((time.monotonic(), work.id))
        except BaseException:
            self._finish(entry, sys.exc_info())

    # -- checkpoints ---------------------------------------------------------------------------

    def _restore(self, entry: FedJob) -> int:
        """Take back the job's checkpoint (an earlier run of it died): samples restored with tokens."""
        if self.checkpoints is None or entry.progress is None:
            return 0
        if not entry.work.ran_before:  # a job known never to have run (a turn job's first run)
            return 0
        chains = self.checkpoints.load(entry.work.id)
        self.checkpoint_stats.commands += 1
        if not chains:
            return 0
        entry.checkpointed = True
        if not self._adapters_of_checkpoint(entry):
            return 0
        restored = entry.progress.restore(chains)
        tokens = sum(len(p.token_ids) for chain in chains.values() for p in chain)
        self.checkpoint_stats.resumed_samples += restored
        self.checkpoint_stats.resumed_tokens += tokens
        log.info("job %s: resumed %d samples from its checkpoint (%d tokens kept)", entry.work.id, restored, tokens)
        return restored

    def _adapters_of_checkpoint(self, entry: FedJob) -> bool:
        """Pin the job's requests to the adapter versions its checkpoint's tokens came from (an adapter
        pushed since runs from the job's next run on, not mid-sample); False when one of them is no
        longer stored: the checkpoint is not used and the samples start over on the current version."""
        assert entry.batch is not None and entry.progress is not None and self.checkpoints is not None
        pins = job_adapters(entry.batch.requests)
        if not pins:
            return True
        saved = self.checkpoints.load_adapters(entry.work.id)
        self.checkpoint_stats.commands += 1
        if saved is None or saved == pins:
            return True
        try:
            pin_stored(saved, self.engine, self.connection, context.current().pool)
            requests = repin(entry.batch.requests, saved)
        except UnsupportedRequestError as exc:
            log.warning("job %s: its checkpoint is not used (%s); its samples start over on %s", entry.work.id, exc,
                        pins)
            return False
        entry.batch.requests = entry.progress.requests = requests
        log.info("job %s: resumed on the adapter versions its checkpoint holds (%s; current %s)", entry.work.id,
                 saved, pins)
        return True

    def checkpoint(self, entries: list[FedJob] | None = None, *, live: bool = True) -> int:
        """Save what the jobs in flight (or `entries`) generated since their last checkpoint, with
        `live` the samples still running (the engine's `progress()`); the tokens saved."""
        if self.checkpoints is None:
            return 0
        saves = []
        for entry in list(self._entries.values()) if entries is None else entries:
            if entry.progress is None or entry.canceled:
                continue
            if not live:  # the completion thread, between a job's record and its continuation
                pieces = entry.progress.unsaved()
            elif not self._submit_lock.acquire(blocking=False):
                return 0  # a partial swap holds the engine: its interrupted samples are saved as they return
            else:
                try:  # nothing submits (nor changes a job's progress) meanwhile
                    pieces = entry.progress.unsaved(self._snapshot(entry) if self.can_snapshot else None)
                finally:
                    self._submit_lock.release()
            if pieces:
                saves.append((entry, pieces))
        if not saves:
            return 0
        try:
            written = self.checkpoints.save([(e.work.id, e.writer, pieces) for e, pieces in saves],
                                            {e.work.id: job_adapters(e.progress.requests) for e, _ in saves
                                             if e.progress is not None})
        except redis.RedisError as exc:
            log.warning("worker %s: a checkpoint was not saved (%s); the next one saves it", self.worker_id, exc)
            return 0
        tokens = 0
        for entry, pieces in saves:
            entry.progress.mark_saved(pieces)  # type: ignore[union-attr]
            entry.checkpointed = True
            tokens += sum(len(p.token_ids) for p in pieces)
        stats = self.checkpoint_stats
        stats.saves += 1
        stats.commands += 2 * len(saves)
        stats.pieces += sum(len(pieces) for _, pieces in saves)
        stats.tokens += tokens
        stats.bytes += written
        return tokens

    def _snapshot(self, entry: FedJob) -> tuple[Submission, Any] | None:
        """The engine's snapshot of the job's running submission (`progress()`), or None; the caller
        holds `_submit_lock`."""
        future, submission = entry.future, entry.submission
        if future is None or submission is None or future.done():
            return None
        outputs = self.engine.progress(future)  # type: ignore[attr-defined]
        return None if outputs is None else (submission, outputs)

    # -- streamed turns ------------------------------------------------------------------------

    def stream_turns(self) -> int:
        """Publish the tokens the streamed turns in flight generated since the last call, in one
        round trip (`pipeline.core.jobs.turn_stream`); the number of deltas sent."""
        entries = [e for e in list(self._entries.values()) if e.streams is not None and e.progress is not None
                   and not e.canceled]
        if not entries or not self._submit_lock.acquire(blocking=False):
            return 0  # a partial swap holds the engine: its samples are published once they continue
        try:
            deltas = [d for e in entries
                      for d in e.streams.deltas(e.progress.so_far(self._snapshot(e)))]  # type: ignore[union-attr]
        finally:
            self._submit_lock.release()
        if deltas:
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    turn_stream.append(pipe, deltas)
                    pipe.execute()
            except redis.RedisError as exc:  # sent again with the next ones (or the rows end the turn)
                log.warning("worker %s: streamed tokens not published (%s)", self.worker_id, exc)
                for entry in entries:
                    entry.streams.unpublish(deltas)  # type: ignore[union-attr]
                return 0
        return len(deltas)

    def _stream_every(self) -> float | None:
        """How often to publish now: `FIRST_EVERY_S` while a streamed turn waits for its first tokens,
        `EVERY_S` once they all have some; None with no streamed turn in flight."""
        streams = [e.streams for e in list(self._entries.values()) if e.streams is not None]
        if not streams:
            return None
        return turn_stream.EVERY_S if all(s.started for s in streams) else turn_stream.FIRST_EVERY_S

    def _stream_if_due(self) -> None:
        every = self._stream_every() if self.can_stream else None
        if every is not None and time.monotonic() >= self._next_stream:
            self.stream_turns()
            self._next_stream = time.monotonic() + (self._stream_every() or every)

    def _checkpoint_if_due(self) -> None:
        if self.checkpoints is None or not self.can_snapshot or time.monotonic() < self._next_checkpoint:
            return
        self._next_checkpoint = time.monotonic() + self.checkpoint_every_s
        self.checkpoint()

    def _submit(self, entry: FedJob, submission: Submission) -> None:
        """Hand a submission to the engine (holding `_submit_lock`); its end reaches the commit thread."""
        entry.submission = submission
        submit = self.engine.submit
        if entry.streams is not None:  # an engine that streams only when asked (`submit_streamed`)
            submit = getattr(self.engine, "submit_streamed", submit)
        future = submit(submission.requests)
        entry.future = future
        future.add_done_callback(lambda _: self._done.put(entry))

    # -- partial weight swaps ------------------------------------------------------------------

    def partial_swap(self, load: Callable[[], Any]) -> int:
        """Stop every sample in flight, `load` the new weights, continue the samples on them.

        New jobs wait meanwhile (the gate); jobs in flight are not drained. Returns the number of
        samples the engine stopped. Their batches resolve at once; the commit thread parks each
        job so stopped until the load is done, then this submits their continuations, before any
        new job (a job the commit thread reaches later continues from there).
        """
        with self.gate.exclusive(drain=False), self._submit_lock:
            with self._cond:
                self._swapping = True
            try:
                stopped = self.engine.interrupt()  # type: ignore[attr-defined]
                load()
            finally:
                with self._cond:
                    self._swapping = False
                    parked, self._parked = self._parked, []
                for entry in parked:
                    self._continue(entry)
        return stopped

    def repin_adapter(self, name: str, version: int) -> int:
        """Pin the jobs in flight that run an older version of adapter `name` to `version` (during a
        partial swap's load, the engine's samples stopped): their samples continue on it. The rows
        keep each token's version (`Progress`); the job's admission pin stays its `adapter_version`.
        Returns the number of jobs re-pinned."""
        count = 0
        for entry in list(self._entries.values()):
            progress = entry.progress
            if progress is None or job_adapters(progress.requests).get(name, version) >= version:
                continue
            progress.requests = repin(progress.requests, {name: version})
            count += 1
        return count

    def adapter_jobs(self, name: str, older_than: int) -> int:
        """How many jobs in flight run a version of adapter `name` older than `older_than`."""
        return sum(1 for entry in list(self._entries.values()) if entry.progress is not None
                   and job_adapters(entry.progress.requests).get(name, older_than) < older_than)

    def _continue(self, entry: FedJob) -> None:
        """Submit a job's unfinished samples again (after a swap's load); park them during one."""
        with self._cond:
            if self._swapping:
                self._parked.append(entry)
                return
        try:
            assert entry.progress is not None
            if entry.canceled:
                raise JobCanceledError(f"job {entry.work.id} was canceled; nothing was written")
            with self._submit_lock:
                self._submit(entry, entry.progress.resume(self.engine.weight_version))
        except BaseException:
            with logs.job_scope(entry.work.id, entry.work.payload, self.worker_id):
                self._finish(entry, sys.exc_info())

    # -- completion (the feeder's thread) ---------------------------------------------------

    def _complete_loop(self) -> None:
        while True:
            try:
                entry = self._done.get(timeout=(self._stream_every() if self.can_stream else None) or 0.5)
            except queue_mod.Empty:
                self._check_deadlines()
                self._checkpoint_if_due()
                self._stream_if_due()
                continue
            if entry is None:
                return
            if isinstance(entry, str):  # WAKE
                self._stream_if_due()
                continue
            with logs.job_scope(entry.work.id, entry.work.payload, self.worker_id):
                self._complete(entry)
            self._check_deadlines()
            self._checkpoint_if_due()
            self._stream_if_due()

    def _check_deadlines(self) -> None:
        moment = time.monotonic()
        for entry in list(self._entries.values()):
            if entry.future is not None and not entry.timed_out and moment > entry.deadline:
                entry.timed_out = True
                if not entry.future.cancel():  # already done: its completion is queued
                    entry.timed_out = False

    def _complete(self, entry: FedJob) -> None:
        try:
            if entry.canceled:
                raise JobCanceledError(f"job {entry.work.id} was canceled; its requests were aborted, nothing written")
            if entry.timed_out:
                raise JobTimeoutException(
                    f"Task exceeded maximum timeout value ({entry.timeout_s} seconds); its requests were aborted"
                )
            outputs = entry.future.result()
            assert entry.batch is not None and entry.progress is not None and entry.submission is not None
            progress = entry.progress
            progress.record(entry.submission, outputs)
            if progress.done:  # the staleness bound, against the weights served now
                progress.stale(self.engine.weight_version)
            if not progress.done:  # stopped by a partial swap (or too stale): continues on the new weights
                self.checkpoint([entry], live=False)
                self._continue(entry)
                return
            decode = self.engine.decode if self.can_interrupt else None  # type: ignore[attr-defined]
            summary = commit_batch(entry.batch, progress.outputs(decode), self.connection, datetime.now(UTC))
            if progress.continued:
                summary.update(continued=progress.continued, restarted=progress.restarted)
            if progress.resumed:
                summary.update(resumed=progress.resumed)
            if entry.checkpointed and self.checkpoints is not None:
                self.checkpoints.delete(entry.work.id)
                self.checkpoint_stats.commands += 1
        except BaseException:
            self._finish(entry, sys.exc_info())
            return
        self._finish(entry, None, summary)

    def _finish(self, entry: FedJob, exc_info: ExcInfo | None, result: Any = None) -> None:
        try:
            entry.work.finish(exc_info, result)
        except Exception:  # a job's end must never kill the completion thread
            log.exception("worker %s: finishing job %s failed", self.worker_id, entry.work.id)
        finally:
            with self._cond:
                self._entries.pop(entry.work.id, None)
                self._cond.notify_all()
            self.jobs_changed(None)
            self.gate.leave()
