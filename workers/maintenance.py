"""Finding abandoned jobs in seconds: RQ's registry maintenance, on a short and bounded clock.

A worker killed with SIGKILL leaves its execution in the queue's `StartedJobRegistry`; its
heartbeat stops, the entry's score (last heartbeat + TTL) passes, and RQ's
`StartedJobRegistry.cleanup` (RQ 3.0) retries the job if it has retries left, else moves it to
the failed registry with `AbandonedJobError`. RQ runs that cleanup only from idle workers'
dequeue loops, every `maintenance_interval` (default ten minutes), under a lock held for
up to 15 minutes, and a job killed between dequeue and start waits a minute in the
intermediate queue. Here:

- a thread runs the cleanup every `maintenance_interval` seconds, busy or idle;
- the lock expires after `2 × maintenance_interval` (a worker killed holding it delays
  the next cleanup by that much, not 15 minutes);
- jobs stuck in the intermediate queue are recovered after `stuck_after_s`.

So a dead worker's job runs again within about heartbeat TTL + maintenance interval.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import redis
from rq import worker_registration
from rq.registry import clean_registries
from rq.utils import now

log = logging.getLogger(__name__)

DEFAULT_MAINTENANCE_INTERVAL_S = 10
DEFAULT_STUCK_AFTER_S = 60.0


class FastMaintenanceMixin:
    """For an RQ worker: frequent, bounded registry cleanup from a thread as well as the work loop."""

    stuck_after_s: float = DEFAULT_STUCK_AFTER_S
    _maintenance_stop: threading.Event | None = None
    _maintenance_thread: threading.Thread | None = None

    def clean_registries(self) -> None:
        worker: Any = self
        lock_ttl = max(2, int(worker.maintenance_interval) * 2)
        for queue in worker.queues:
            if not worker.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=lock_ttl):
                continue
            try:
                clean_registries(queue, worker._exc_handlers)
                worker_registration.clean_worker_registry(queue)
                self._recover_intermediate(queue)
            finally:
                worker.connection.delete(queue.registry_cleaning_key)
        worker.last_cleaned_at = now()

    def _recover_intermediate(self, queue: Any) -> None:
        """Jobs dequeued by a worker that died before starting them go back through the failure path."""
        worker: Any = self
        intermediate = queue.intermediate_queue
        started = queue.started_job_registry
        for job_id in intermediate.get_job_ids():
            if job_id in started:
                continue
            job = queue.fetch_job(job_id)
            if job is None:
                intermediate.remove(job_id)
                continue
            if intermediate.set_first_seen(job_id):
                continue
            first_seen = intermediate.get_first_seen(job_id)
            if first_seen is None or now() - first_seen < timedelta(seconds=self.stuck_after_s):
                continue
            log.warning("job %s was dequeued but never started (worker died?); recovering it", job_id)
            worker.handle_job_failure(job, queue, exc_string="Job was stuck in intermediate queue (worker died?).")
            intermediate.remove(job_id)

    def start_maintenance_thread(self) -> None:
        self._maintenance_stop = threading.Event()
        self._maintenance_thread = threading.Thread(target=self._maintenance_loop, name="maintenance", daemon=True)
        self._maintenance_thread.start()

    def stop_maintenance_thread(self) -> None:
        if self._maintenance_stop is not None:
            self._maintenance_stop.set()
        if self._maintenance_thread is not None:
            self._maintenance_thread.join(timeout=5)

    def _maintenance_loop(self) -> None:
        worker: Any = self
        assert self._maintenance_stop is not None
        while not self._maintenance_stop.wait(worker.maintenance_interval):
            try:
                self.clean_registries()
            except redis.RedisError as exc:
                log.warning("registry maintenance failed: %s", exc)
            except Exception:  # the thread must outlive any one failure
                log.exception("registry maintenance failed")
