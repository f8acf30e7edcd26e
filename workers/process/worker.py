"""The worker process `pipeline worker` runs: `EngineWorker` (engine, heartbeat and registry,
control follower, job intake, feeder; `workers.process.engine_worker`) plus fault handling:

- abandoned jobs of dead workers found within seconds (`workers.jobs.maintenance`), and jobs a
  Redis failover orphaned requeued (`workers.jobs.reconcile`);
- SIGTERM: warm shutdown; a second SIGTERM aborts the job and hands it back (`workers.process.shutdown`);
- an engine that fails makes the worker hand its job back, mark itself unhealthy and stop
  dequeuing until a health probe passes (`workers.process.health`).

Hand-backs (`workers.jobs.handback`) requeue the job at the front of its queue without spending
one of its retries; other failures take RQ's ordinary path: retries after a backoff (RQ's
scheduled registry, enqueued when due by `workers.jobs.maintenance`; a burst worker waits for
them), then failed. A job refused for what it asks (`UnsupportedRequestError`,
`NotAllowedJobError`) is not retried: every retry would be refused the same way.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from types import FrameType
from typing import Any

import redis
from rq import Queue
from rq.executions import Execution
from rq.group import Group
from rq.job import Job, JobStatus
from rq.utils import now
from setproctitle import setproctitle

from pipeline.core import settings
from pipeline.core.broker.connection import stop_reconnecting
from pipeline.core.jobs import rq_seam
from pipeline.core.jobs.queue import RESULT_TTL_S as CANCELED_TTL_S
from schemas.worker_info import WorkerState
from workers.engines.base import Engine
from workers.errors import JobCanceledError, NotAllowedJobError, UnsupportedRequestError
from workers.jobs import admission
from workers.jobs.handback import hand_back_dequeued, hand_back_started
from workers.jobs.maintenance import DEFAULT_MAINTENANCE_INTERVAL_S, DEFAULT_STUCK_AFTER_S, RegistryMaintenance
from workers.jobs.reconcile import Reconciler
from workers.process.engine_worker import EngineWorker
from workers.process.health import PROBE_MAX_S, EngineHealth
from workers.process.shutdown import Shutdown

log = logging.getLogger(__name__)


class RolloutWorker(EngineWorker):
    """A rollout worker that survives its neighbours' deaths, its own shutdown and its engine's failures."""

    def __init__(
        self,
        conn: redis.Redis,
        engine: Engine,
        *,
        maintenance_interval_s: float = DEFAULT_MAINTENANCE_INTERVAL_S,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        probe_max_s: float = PROBE_MAX_S,
        **kwargs: Any,
    ) -> None:
        interval = max(1, math.ceil(maintenance_interval_s))
        # RQ blocks an idle worker's dequeue for worker_ttl - 15 s; keep that to one interval.
        kwargs.setdefault("worker_ttl", interval + 15)
        super().__init__(conn, engine, maintenance_interval=interval, **kwargs)
        self.health = EngineHealth(engine, self.metrics, worker_name=self.name, probe_max_s=probe_max_s)
        self.shutdown = Shutdown(self.name)
        self.maintenance = RegistryMaintenance(
            conn, self.queues, interval_s=interval, stuck_after_s=stuck_after_s,
            exception_handlers=rq_seam.exception_handlers(self),
            fail_job=lambda job, queue, reason: self.handle_job_failure(job, queue, exc_string=reason),
            # One for all of the pool's queues: a job is held if any of them holds it.
            reconcilers=[Reconciler(conn, self.queues, self.pool.name, grace_s=stuck_after_s, interval_s=interval)],
        )
        self.turn_ends.handback_reason = lambda exc: self.shutdown.handback_reason(exc) or self.health.job_failed(exc)
        # RQ passes a failing job's exception to handle_exception, then (same thread) calls
        # handle_job_failure without it. Jobs fail on two threads (the work loop, and the
        # feeder's completion thread), so the exception is kept per thread.
        self._failing = threading.local()

    # -- registry ---------------------------------------------------------------------------------

    def _resting_state(self) -> WorkerState:
        return "unhealthy" if self.health.reason else super()._resting_state()

    def _ready_for_turns(self) -> bool:
        return self.health.reason is None and super()._ready_for_turns()

    def _registry_error(self) -> str | None:
        # One publish with the state: a reader never sees `unhealthy` without its reason.
        return self.health.reason or super()._registry_error()

    # -- dequeue and failure ------------------------------------------------------------------

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        while True:
            healthy = self.health.wait(
                burst=timeout is None, stopping=lambda: rq_seam.stop_requested(self),
                report=lambda: self.set_registry_state(self._resting_state()), keepalive=self.heartbeat,
            )
            if not healthy:
                return None
            # A retry scheduled before the dequeue looked: if it is gone from the registry after an
            # empty dequeue, the maintenance thread moved it to the queue meanwhile: look again.
            scheduled = timeout is None and not rq_seam.stop_requested(self) and \
                self.maintenance.next_retry_in() is not None
            result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            if result is None and timeout is None and (self._await_scheduled_retry() or scheduled):
                continue  # burst mode: a retry waiting out its backoff is still this worker's to run
            if result is None or self.health.reason is None:
                return result
            # The engine failed while this worker was blocked in its dequeue (another job in flight
            # failed): give the job back untouched and wait for the engine.
            job, queue = result
            hand_back_dequeued(self.connection, job, queue, at_front=True)

    def _await_scheduled_retry(self) -> bool:
        """Sleep until the earliest scheduled retry is due and enqueue it; False when there is none."""
        wait = self.maintenance.next_retry_in()
        if wait is None or rq_seam.stop_requested(self):
            return False
        time.sleep(min(wait, self.maintenance.interval_s) + 0.05)
        self.maintenance.enqueue_due_retries()
        return True

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        self._failing.exception = exc_info[1] if len(exc_info) > 1 else None
        if isinstance(self._failing.exception, JobCanceledError):
            log.info("worker %s: job %s canceled", self.worker_id, job.id)  # not an error: no traceback
            return
        if self.shutdown.handback_reason(self._failing.exception):
            return  # aborted by a second signal, not failed: `handle_job_failure` hands it back, in one line
        super().handle_exception(job, *exc_info)

    def _take_job_exception(self) -> BaseException | None:
        """The exception of the job this thread is failing (once)."""
        exc = getattr(self._failing, "exception", None)
        self._failing.exception = None
        return exc

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Execution | None = None,
    ) -> None:
        if execution is not None:  # a job this worker ran (not a dead worker's, found by maintenance)
            exc = self._take_job_exception()
            if isinstance(exc, JobCanceledError):
                self._finish_canceled(job, execution)
                return
            if isinstance(exc, UnsupportedRequestError) and self._hand_back_refused(job, queue, execution, exc):
                return
            reason = self.shutdown.handback_reason(exc) or self.health.job_failed(exc)
            if reason and hand_back_started(self, job, queue, execution, reason=reason):
                self.metrics.job_handed_back()
                return
            if isinstance(exc, UnsupportedRequestError | NotAllowedJobError) and job.retries_left:
                job.retries_left = 0  # the request's fault: every retry would be refused the same way
            self.metrics.job_failed(retried=job.should_retry and rq_seam.stopped_job_id(self) != job.id)
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
                                   execution=execution)
        self.maintenance.wake()  # a retry it scheduled is looked for when due, not at the idle pace

    def _finish_canceled(self, job: Job, execution: Execution) -> None:
        """A canceled job ends `canceled`, never retried; RQ's started registry lets go of it."""
        with self.connection.pipeline() as pipe:
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            pipe.expire(job.key, CANCELED_TTL_S)
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            pipe.execute()
        self.metrics.job_canceled()

    def _hand_back_refused(self, job: Job, queue: Queue, execution: Execution, exc: BaseException) -> bool:
        """A deterministic refusal: never retried on this worker. The job is handed back, no retry
        spent, and `workers.jobs.admission` finds it another worker (or fails it) when it is dequeued
        again. False past the hand-back limit."""
        admission.note_refusal(job, self.worker_id, str(exc))
        if hand_back_started(self, job, queue, execution, reason=f"refused by {self.worker_id}: {exc}"):
            self.metrics.job_handed_back()
            return True
        return False

    # -- shutdown and maintenance ---------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        """RQ's hook for the first SIGTERM/SIGINT (warm shutdown); Redis unreachable from now on is not
        waited for past `PIPELINE_STOPPING_RECONNECT_S` (`workers.process.shutdown`)."""
        stop_reconnecting(self.connection, settings.stopping_reconnect_s())
        if self.feeder.in_flight:
            log.warning("worker %s: finishing %d job(s) in flight, then exiting; a second SIGTERM (Ctrl-C) "
                        "hands them back to their queue now", self.worker_id, self.feeder.in_flight)
        super().request_stop(signum, frame)

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """RQ's hook for the second SIGTERM/SIGINT: hand the jobs in hand back (`workers.process.shutdown`)."""
        if self.shutdown.is_repeat(rq_seam.shutdown_requested_at(self)):
            return
        stop_reconnecting(self.connection)
        rq_seam.request_stop(self)
        self.shutdown.abort([e.job_id for e in self.executions.values()], signal.Signals(signum).name)

    def aborting(self) -> bool:
        return self.shutdown.aborting

    def clean_registries(self) -> None:
        """RQ's own maintenance call, bounded as `workers.jobs.maintenance` describes (and, like the
        maintenance thread's, skipped when another worker of the pool cleaned within the interval)."""
        self.maintenance.periodic_clean()
        self.last_cleaned_at = now()

    def clean_group_registries(self) -> None:
        """RQ's group-registry maintenance as RQ does it, logged at DEBUG (RQ logs it at INFO at every
        maintenance interval, a line every 10 s in an idle worker's log)."""
        if Group.acquire_maintenance_lock(self.connection, max(int(self.maintenance_interval) - 1, 1)):
            log.debug("worker %s: cleaning RQ's group registries", self.name)
            Group.clean_registries(connection=self.connection)

    def procline(self, message: str) -> None:
        """The process title `ps` shows: `pipeline worker (pool, engine, model): what it is doing`
        (RQ's would be `rq:worker:<id>: ...`)."""
        info = getattr(self, "info", None)
        who = f"{self.pool.name}, {info.engine}, {info.model}" if info is not None else self.pool.name
        setproctitle(f"pipeline worker ({who}): {message}")

    # -- lifecycle --------------------------------------------------------------------------

    def work(self, *args: Any, **kwargs: Any) -> bool:
        self.maintenance.start()
        try:
            return super().work(*args, **kwargs)
        finally:
            self.maintenance.stop()
