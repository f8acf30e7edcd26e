"""The worker process `pipeline worker` runs: `EngineWorker` (engine, heartbeats, registry,
control channel, feeding; `workers.engine_worker`) plus fault handling:

- abandoned jobs of dead workers found within seconds (`workers.maintenance`);
- SIGTERM: warm shutdown; a second SIGTERM aborts the job and hands it back (`workers.shutdown`);
- an engine that fails makes the worker hand its job back, mark itself unhealthy and stop
  dequeuing until a health probe passes (`workers.health`).

Hand-backs (`workers.handback`) requeue the job at the front of its queue without spending
one of its retries; other failures take RQ's ordinary path (retries, then failed).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import redis
from rq import Queue
from rq.executions import Execution
from rq.job import Job

from schemas.worker_info import WorkerState
from workers import control
from workers.engine_worker import EngineWorker
from workers.engines.base import Engine
from workers.handback import hand_back_started
from workers.health import PROBE_MAX_S, EngineHealthMixin
from workers.maintenance import DEFAULT_MAINTENANCE_INTERVAL_S, DEFAULT_STUCK_AFTER_S, FastMaintenanceMixin
from workers.shutdown import GracefulShutdownMixin

log = logging.getLogger(__name__)


class RolloutWorker(GracefulShutdownMixin, EngineHealthMixin, FastMaintenanceMixin, EngineWorker):
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
        self.stuck_after_s = stuck_after_s
        self.probe_max_s = probe_max_s
        self.probe_initial_s = min(self.probe_initial_s, probe_max_s)

    # -- registry ---------------------------------------------------------------------------------

    def _resting_state(self) -> WorkerState:
        return "unhealthy" if self.unhealthy_reason else super()._resting_state()

    def set_registry_state(self, state: WorkerState, current_job: str | None = None) -> None:
        super().set_registry_state(state, current_job)
        if self.unhealthy_reason and self.info.error != self.unhealthy_reason:
            with self._lock:
                self.info.error = self.unhealthy_reason
            self._publish()

    # -- dequeue and failure ------------------------------------------------------------------

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        while True:
            if not self.wait_until_healthy(burst=timeout is None):
                return None
            result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            if result is None or self.unhealthy_reason is None:
                return result
            # The engine failed while this worker was blocked in its dequeue (another job in flight
            # failed): give the job back untouched and wait for the engine.
            job, queue = result
            control.hand_back(self.connection, job, queue, at_front=True)

    def handle_job_failure(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: Any = None,
        exc_string: str = "",
        execution: Execution | None = None,
    ) -> None:
        if execution is not None:  # a job this worker ran (not a dead worker's, found by maintenance)
            exc = self.take_job_exception()
            reason = self.shutdown_handback_reason(exc) or self.health_handback_reason(exc)
            if reason and hand_back_started(self, job, queue, execution, reason=reason):
                self.metrics.job_handed_back()
                return
            self.metrics.job_failed(retried=job.should_retry and self._stopped_job_id != job.id)
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry, exc_string=exc_string,
                                   execution=execution)

    # -- lifecycle --------------------------------------------------------------------------

    def work(self, *args: Any, **kwargs: Any) -> bool:
        self.start_maintenance_thread()
        try:
            return super().work(*args, **kwargs)
        finally:
            self.stop_maintenance_thread()
