"""The worker's core: an in-process RQ worker that keeps one engine loaded.

`workers.process.worker.RolloutWorker` adds fault handling on top; that is the class to run.

RQ's forking worker would reload the engine per job, so this builds on `SimpleWorker`. It is the
composition of the parts a worker holds, and overrides RQ's hooks only to hand each its work:

- `workers.process.heartbeat.Heartbeat`: the registry entry (`pipeline status`) and the
  heartbeats of the jobs in flight, refreshed by a thread (`SimpleWorker` never refreshes them
  during a job);
- `workers.process.control_follower.ControlFollower`: the pool's desired state (pause, weights),
  followed on a listener thread and before every job; weight loads and their acknowledgements;
- `workers.process.intake.JobIntake`: which dequeued jobs run (pause, capabilities, weight
  versions); the others are handed back untouched;
- `workers.process.turn_reader.TurnReader`: the turns routed to this worker (its turn queue, a
  Redis stream), read on a thread of their own straight into the feeder, not through RQ;
- `workers.jobs.feeder.Feeder`: every job's run on the engine, each ended by its records. With an
  engine that has the concurrent interface (hf, sim, sglang-http, vllm-http) `execute_job`
  returns once the engine has room, so the next job's requests reach the engine while this one's
  last sequences finish; each job still gets its own shard, commit, heartbeats and RQ result. An
  engine with only `generate()` (the shipped fake, in-process SGLang) and any engine of a worker
  started with `--no-feed` is fed through `workers.engines.serial.SerialEngine`, one job at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import StopRequested
from rq.executions import Execution
from rq.job import Job, Retry
from rq.serializers import JSONSerializer
from rq.utils import now

from pipeline.core.broker import keys
from pipeline.core.jobs import rq_seam
from schemas.control import DesiredState
from schemas.worker_info import WorkerState
from workers.engines.adapters.cache import resident_adapters
from workers.engines.base import Engine, is_concurrent
from workers.engines.serial import SerialEngine
from workers.jobs import admission, context
from workers.jobs.allowed_job import RolloutJob
from workers.jobs.checkpoint import DEFAULT_CHECKPOINT_EVERY_S
from workers.jobs.feeder import DEFAULT_MAX_JOBS_IN_FLIGHT, Feeder
from workers.jobs.turn_commits import TurnFlusher
from workers.jobs.work import RqWork, Work
from workers.process.control_follower import POLL_S, ControlFollower
from workers.process.heartbeat import HEARTBEAT_INTERVAL_S, Heartbeat, worker_info
from workers.process.intake import JobIntake
from workers.process.metrics import DEFAULT_METRICS_HOST, WorkerMetrics, queue_wait_s
from workers.process.turn_reader import TurnReader
from workers.process.turn_work import TurnEnds, TurnWork

log = logging.getLogger(__name__)

EXIT_NOW_S = 5.0  # what a second signal with nothing in flight leaves the worker to leave with
RQ_HEARTBEAT_S = 30  # RQ's own worker key (it lives 8 minutes), refreshed no more often than this
DRAIN_POLL_S = 0.1  # how often a warm shutdown's wait for the jobs in flight looks for a second signal


LANE_CHECK_S = 5.0  # how often a worker looks whether its pool serves agent turns
TURNS_ACTIVE_BUCKETS = 7  # ... in the last this many buckets of `keys.TURN_RATE_BUCKET_S` (about a minute)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def pool_queues(conn: redis.Redis, pool: keys.PoolKeys) -> list[Queue]:
    """The RQ queue a worker of `pool` takes jobs from: the pool's batch queue. Agent turns come
    through its turn queue and the pool's shared lane (`workers.process.turn_reader`)."""
    return [Queue(pool.queue_name, connection=conn, serializer=JSONSerializer)]


class EngineWorker(SimpleWorker):
    """A `SimpleWorker` around a loaded engine: heartbeat, control follower, job intake and feeder."""

    def __init__(
        self,
        conn: redis.Redis,
        engine: Engine,
        *,
        worker_id: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        control_poll_s: float = POLL_S,
        feed: bool = True,
        max_jobs_in_flight: int = DEFAULT_MAX_JOBS_IN_FLIGHT,
        feed_headroom: int | None = None,
        checkpoint_every_s: float = DEFAULT_CHECKPOINT_EVERY_S,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_METRICS_HOST,
        pool: str | None = None,
        **kwargs: Any,
    ) -> None:
        worker_id = worker_id or new_worker_id()
        self.pool = keys.pool(pool)
        kwargs.setdefault("job_monitoring_interval", max(1, int(heartbeat_interval_s)))
        super().__init__(
            pool_queues(conn, self.pool),
            connection=conn,
            name=worker_id,
            serializer=JSONSerializer,
            job_class=RolloutJob,
            **kwargs,
        )
        self.worker_id = worker_id
        self.engine = engine
        # Prometheus metrics (`workers.process.metrics`); served on `metrics_port` when given (0: a free port).
        self.metrics = WorkerMetrics(worker_id, engine.description.name)
        self.metrics.set_weight_version(engine.weight_version)
        # One road for every job: the feeder. An engine that cannot take several batches at once
        # (or a worker told not to feed) gets one job at a time, through its generate().
        self._serial: SerialEngine | None = None
        if not (feed and is_concurrent(engine)):
            self._serial = SerialEngine(engine)
            max_jobs_in_flight = 1
        self._waiting_for_job = False  # the loop blocks in RQ's dequeue (`_shutdown`)
        self._lane_checked_at = float("-inf")
        self._lane_seen = False
        self.rq_bookkeeping = rq_seam.WorkerBookkeeping(self)
        self.turn_ends = TurnEnds(conn, worker_id, self.metrics)
        self.feeder = Feeder(
            self._serial or engine,
            connection=conn, worker_id=worker_id, jobs_changed=self._jobs_changed,
            max_jobs_in_flight=max_jobs_in_flight, headroom=feed_headroom, checkpoint_every_s=checkpoint_every_s,
        )
        self.feeder.turns_active = self._turns_active
        self.presence = Heartbeat(conn, worker_info(worker_id, self.pool.name, engine), interval_s=heartbeat_interval_s,
                                  jobs=self._rq_jobs, beat_job=self.maintain_heartbeats)
        self.info = self.presence.info
        self.control = ControlFollower(conn, self.pool, worker_id, engine, self.feeder, self.presence,
                                       report=self.set_registry_state, settle=self._settle, poll_s=control_poll_s)
        self.intake = JobIntake(
            conn, self.pool, worker_id, self.info.capabilities, engine, self.control, self.feeder, self.metrics,
            fail=lambda job, queue, reason: admission.fail(self, job, queue, self.pool.name, reason),
        )
        # The turns routed to this worker: read by a thread of their own, not through RQ.
        self.turn_reader = TurnReader(conn, self.pool, worker_id, self.feeder, self.turn_ends,
                                      capabilities=self.info.capabilities, ready=self._ready_for_turns)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_host)

    def _rq_jobs(self) -> list[tuple[Job, Execution]]:
        """The jobs in flight that RQ keeps records of (whose heartbeats are due): not the turn queue's."""
        return [(work.job, work.execution) for work in self.feeder.works()
                if isinstance(work, RqWork) and work.execution is not None]

    def _ready_for_turns(self) -> bool:
        """Whether the worker takes turns from its turn queue now: not stopping, paused, nor behind the
        pool's weights (the work loop's checks for RQ jobs, `workers.process.intake`)."""
        desired = self.control.desired
        return not rq_seam.stop_requested(self) and not desired.paused and not self.control.behind(desired)

    # -- registry ---------------------------------------------------------------------------------

    def set_registry_state(self, state: WorkerState, current_job: str | None = None) -> None:
        with self.presence.lock:
            self.metrics.set_state(state)
            self.metrics.set_weight_version(self.engine.weight_version)
            self.presence.update(state=state, current_job=current_job, weight_version=self.engine.weight_version,
                                 error=self._registry_error(), adapters=resident_adapters(self.engine))

    def _registry_error(self) -> str | None:
        """What the registry entry says is wrong, published with the state it explains (None: nothing)."""
        return self.control.weight_error

    def _resting_state(self) -> WorkerState:
        return self.control.resting_state()

    def _settle(self) -> None:
        """The resting state in the registry, unless a job is in flight."""
        with self.presence.lock:
            if not self.feeder.in_flight:
                self.set_registry_state(self._resting_state())

    def _jobs_changed(self, started: Work | None) -> None:
        """A job entered (`started`) or left the feeder: busy with the oldest RQ job in flight, or
        resting. Turns of the worker's turn queue leave the registry's state alone (they come and go
        many times a second; `pipeline status` counts them in its agent turns line)."""
        if started is not None:
            self.metrics.job_started(queue_wait_s(started))
            if isinstance(started, TurnWork):
                return
        with self.presence.lock:
            current = next((job.id for job, _ in self._rq_jobs()), None)
            if current is not None:
                self.set_registry_state("busy", current)
            else:
                self.set_registry_state(self._resting_state())

    def sync_control(self) -> DesiredState:
        """Re-read the pool's desired state and follow it (`ControlFollower.sync`)."""
        return self.control.sync()

    # -- RQ's hooks -------------------------------------------------------------------------------

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self.presence.job_ttl

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        """RQ's worker heartbeat (three commands; its key lives `worker_ttl` + 60 s, eight minutes),
        which RQ sends two or three times per job: sent at most every `RQ_HEARTBEAT_S` unless a
        caller names its own timeout. Liveness that matters (jobs, the registry) beats elsewhere."""
        last = self.last_heartbeat
        if timeout is None and last is not None and (now() - last).total_seconds() < RQ_HEARTBEAT_S:
            return
        super().heartbeat(timeout, pipeline)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        """RQ's worker state, written only when it changes (RQ writes `idle` before every dequeue)."""
        if pipeline is None and state == self.get_state():
            return
        super().set_state(state, pipeline)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        def rq_dequeue() -> tuple[Job, Queue] | None:
            self._waiting_for_job = True
            try:
                if rq_seam.stop_requested(self):  # asked while busy, just before this wait: stop now
                    raise StopRequested()
                while not self.feeder.has_room(batch=True):
                    # The batch share of the engine is full (its reserve for agent turns is the turn
                    # reader's to fill): wait for it, with the worker's heartbeat every second.
                    until = time.monotonic() + 1
                    self.feeder.wait_for_room(
                        lambda until=until: rq_seam.stop_requested(self) or time.monotonic() > until, batch=True)
                    if rq_seam.stop_requested(self):
                        raise StopRequested()
                    self.heartbeat()
                return super(EngineWorker, self).dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            finally:
                self._waiting_for_job = False

        return self.intake.dequeue(rq_dequeue, burst=timeout is None, stopping=lambda: rq_seam.stop_requested(self))

    def _turns_active(self) -> bool:
        """Whether the pool committed an agent turn in the last minute (read at most every 5 s)."""
        now = time.monotonic()
        if now - self._lane_checked_at > LANE_CHECK_S:
            bucket = int(time.time()) // keys.TURN_RATE_BUCKET_S
            with contextlib.suppress(redis.RedisError):  # Redis away: keep what was seen last
                self._lane_seen = bool(self.connection.exists(
                    *(self.pool.turns_in(bucket - i) for i in range(TURNS_ACTIVE_BUCKETS))))
            self._lane_checked_at = now
        return self._lane_seen

    def _shutdown(self) -> None:
        """A warm shutdown while the loop waits in RQ's dequeue stops the wait at once, as RQ does for
        an idle worker, also while jobs run on in the feeder (RQ then calls the worker busy and would
        wait out the dequeue's timeout, minutes); `work()` lets those jobs finish and commit."""
        if self._waiting_for_job:
            raise StopRequested()
        super()._shutdown()

    def unsubscribe(self) -> None:
        """RQ's, with a bounded wait. RQ stops its pub/sub thread with redis-py's
        `PubSubWorkerThread.stop()`, which joins without a timeout, while that thread may sit in a
        60 s wait for a subscription once it has read the unsubscribe's reply: a SIGTERMed idle worker
        hung up to a minute there (the test of pools on the command line failed on it in CI). The
        thread is a daemon; it is told to stop and given a second."""
        if self.pubsub_thread is None:
            return
        log.info("worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        with contextlib.suppress(redis.RedisError):  # Redis gone: nothing to unsubscribe from
            self.pubsub.unsubscribe()
        self.pubsub_thread.stop(timeout=1)
        self.pubsub.close()

    def execute_job(self, job: Job, queue: Queue) -> None:
        self.feeder.admit(RqWork(job, queue, self.rq_bookkeeping))
        self.feeder.wait_for_room(lambda: rq_seam.stop_requested(self))

    def _finalize_success(self, job: Job, queue: Queue, execution: Execution, return_value: Any) -> None:
        super()._finalize_success(job, queue, execution, return_value)
        if not isinstance(return_value, Retry):
            self.metrics.job_finished(return_value)

    def aborting(self) -> bool:
        """Whether a second shutdown signal asked to abort the jobs in flight (`workers.process.shutdown`)."""
        return False

    def _drain_feeder(self) -> None:
        """Warm shutdown: the jobs in flight finish and commit; once `aborting()`, the engine aborts
        them instead (each then fails, and is handed back, on the feeder's thread)."""
        while not self.feeder.drain(timeout=DRAIN_POLL_S):
            if self.aborting():
                self.feeder.abort_all()
                self.feeder.drain(timeout=10)
                return

    def work(self, *args: Any, **kwargs: Any) -> bool:
        context.install(context.WorkerContext(worker_id=self.worker_id, engine=self.engine, pool=self.pool.name))
        self.presence.joined = False  # loading the pool's weights before joining: not a member yet
        try:
            self.control.join()
        except BaseException:
            context.uninstall()
            raise
        self.presence.joined = True
        self.set_registry_state("idle")
        self.presence.start()
        self.control.listener.start()
        self.feeder.start()
        # Agent turns' rows, logged in Redis as they commit, written many turns to a shard.
        flusher = TurnFlusher(lambda: self.connection)
        flusher.start()
        # Its turn queue (session affinity), and what no live worker runs of dead neighbours'.
        self.turn_reader.start()
        try:
            return super().work(*args, **kwargs)
        finally:
            if self.shutdown.exiting:
                # A second signal with nothing in flight exits now: leaving gets EXIT_NOW_S in all, not a
                # wait for each thread (with Redis gone, threads stuck in it made that minutes). What it
                # does not finish is taken over: turn entries by the live workers, the registry entry by
                # its TTL, logged turns by another worker's flusher.
                leaving = threading.Thread(target=self._leave, args=(flusher,), name="leaving", daemon=True)
                leaving.start()
                leaving.join(timeout=EXIT_NOW_S)
            else:
                self._leave(flusher)
            context.uninstall()

    def _leave(self, flusher: TurnFlusher) -> None:
        """Stop reading, flush the logged turns, wait for the jobs in flight, leave the registry."""
        self.turn_reader.stop()
        flusher.stop(flush=True)
        try:
            self._drain_feeder()
        except BaseException:  # an exit raised in the wait: abort them rather than leave them running
            self.feeder.abort_all()
            self.feeder.drain(timeout=10)
            raise
        finally:
            self.turn_reader.close()
            self.feeder.stop()
            if self._serial is not None:
                self._serial.close()
        self.control.listener.stop()
        try:
            self.presence.stop()  # out of the registry: its turn queue is read by the live workers now
        except redis.RedisError as exc:  # Redis gone at shutdown: the entry expires with its TTL
            log.warning("worker %s: leaving the registry skipped, Redis unreachable (%s)", self.worker_id, exc)
