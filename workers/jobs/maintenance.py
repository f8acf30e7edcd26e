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
- jobs stuck in the intermediate queue are recovered after `stuck_after_s`;
- retries RQ scheduled for later (jobs are submitted with backoff between attempts) are
  enqueued once due, looked for every second while one is scheduled, every ten seconds while
  none is: workers need no RQ scheduler process;
- a periodic cleanup runs once an interval per pool, by whichever worker claims it first, so an
  idle fleet's Redis load does not grow with its size (an on-demand `clean` always runs);
- jobs whose state a Redis failover orphaned (waiting or running, but held nowhere) are
  requeued (`workers.jobs.reconcile`); for `stuck_after_s` after the Redis master changed, no job is
  taken for abandoned (running jobs' entries may have expired while no master answered, until
  their workers' next heartbeats refresh them).

So a dead worker's job runs again within about heartbeat TTL + maintenance interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import redis
from rq import worker_registration
from rq.job import Job
from rq.queue import Queue
from rq.registry import clean_registries
from rq.utils import now

from pipeline.core.jobs import rq_seam
from workers.jobs.reconcile import ENDED, Reconciler

log = logging.getLogger(__name__)

DEFAULT_MAINTENANCE_INTERVAL_S = 10
DEFAULT_STUCK_AFTER_S = 60.0
RETRY_CHECK_S = 1.0  # how often due retries are looked for while one is scheduled (one ZRANGE per queue)
RETRY_IDLE_CHECK_S = 10.0  # how often while none is
RETRY_LOCK_S = 10


class RegistryMaintenance:
    """Frequent, bounded registry cleanup of some queues, from its own thread as well as on demand."""

    def __init__(
        self, connection: redis.Redis, queues: Sequence[Queue], *, interval_s: int,
        exception_handlers: list[Any], fail_job: Callable[[Job, Queue, str], None],
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S, reconcilers: Sequence[Reconciler] = (),
    ) -> None:
        self.connection = connection
        self.queues = queues
        self.interval_s = interval_s
        self.exception_handlers = exception_handlers  # RQ's registry cleaning hands abandoned jobs to them
        self.fail_job = fail_job  # (job, queue, reason): the worker's failure path (retries, then failed)
        self.stuck_after_s = stuck_after_s
        # Each sweeps all of its pool's queues, under the cleaning lock of its batch queue (the last).
        self.reconcilers = {r.queues[-1].name: r for r in reconcilers}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def clean(self) -> None:
        """Clean each queue's registries unless another worker is at it (a lock of 2 × interval)."""
        lock_ttl = max(2, int(self.interval_s) * 2)
        for reconciler in self.reconcilers.values():
            reconciler.observe_master()
        settling = any(r.settling() for r in self.reconcilers.values())  # see `Reconciler.settling`
        for queue in self.queues:
            reconciler = self.reconcilers.get(queue.name)
            if not self.connection.set(queue.registry_cleaning_key, 1, nx=True, ex=lock_ttl):
                continue
            try:
                if not settling:
                    clean_registries(queue, self.exception_handlers)
                    worker_registration.clean_worker_registry(queue)
                    self._recover_intermediate(queue)
                if reconciler is not None and reconciler.due():
                    reconciler.sweep()
            finally:
                self.connection.delete(queue.registry_cleaning_key)

    def _recover_intermediate(self, queue: Queue) -> None:
        """Jobs dequeued by a worker that died before starting them go back through the failure path."""
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
            self.fail_job(job, queue, "Job was stuck in intermediate queue (worker died?).")
            intermediate.remove(job_id)

    def enqueue_due_retries(self) -> float | None:
        """Retries whose backoff has passed go to their queue (what RQ's scheduler process would do);
        one worker at a time per queue, so none is enqueued twice. Returns the seconds until the
        earliest retry not yet due: 0 when one was due (look again soon), None when none is scheduled."""
        upcoming: float | None = None
        for queue, earliest in zip(self.queues, self._earliest_retries(), strict=True):
            registry = queue.scheduled_job_registry
            if earliest is None:
                continue
            if earliest > time.time():
                upcoming = earliest - time.time() if upcoming is None else min(upcoming, earliest - time.time())
                continue
            upcoming = 0.0
            lock = f"{registry.key}:enqueuing"
            if not self.connection.set(lock, 1, nx=True, ex=RETRY_LOCK_S):
                continue
            try:
                job_ids = registry.get_jobs_to_schedule(int(time.time()))
                jobs = Job.fetch_many(job_ids, connection=self.connection, serializer=queue.serializer)
                with self.connection.pipeline() as pipe:
                    for job_id, job in zip(job_ids, jobs, strict=True):
                        # A job that ended meanwhile (see `workers.jobs.reconcile`) is not run again.
                        if job is not None and job.get_status(refresh=False) not in ENDED:
                            rq_seam.enqueue(queue, job, pipe, at_front=False)
                        registry.remove(job_id, pipeline=pipe)
                    pipe.execute()
            finally:
                self.connection.delete(lock)
        return upcoming

    def _earliest_retries(self) -> list[float | None]:
        """Per queue, when its earliest scheduled retry is due (None: it has none); one round trip."""
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in self.queues:
                pipe.zrange(queue.scheduled_job_registry.key, 0, 0, withscores=True)
            return [found[0][1] if found else None for found in pipe.execute()]

    def next_retry_in(self) -> float | None:
        """Seconds until the earliest scheduled retry of these queues is due (None: there is none)."""
        due = [earliest for earliest in self._earliest_retries() if earliest is not None]
        return max(0.0, min(due) - time.time()) if due else None

    def wake(self) -> None:
        """Look for due retries now (and at the busy pace after): a retry may just have been scheduled."""
        self._wake.set()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="maintenance", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def periodic_clean(self) -> bool:
        """`clean`, unless a worker of the pool began one less than an interval ago (else this one
        claims it): a fleet of idle workers cleans each pool once an interval, not once each."""
        marker = f"{self.queues[-1].registry_cleaning_key}:swept"
        if not self.connection.set(marker, 1, nx=True, ex=max(1, int(self.interval_s))):
            return False
        self.clean()
        return True

    def _loop(self) -> None:
        next_clean = time.monotonic() + self.interval_s
        wait = min(RETRY_CHECK_S, self.interval_s)
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                # With no retry scheduled, look less often: a retry another worker schedules is at
                # most RETRY_IDLE_CHECK_S late (its backoff is seconds to minutes).
                upcoming = self.enqueue_due_retries()
                wait = min(self.interval_s, RETRY_IDLE_CHECK_S if upcoming is None else max(upcoming, RETRY_CHECK_S))
                if time.monotonic() >= next_clean:
                    next_clean = time.monotonic() + self.interval_s
                    self.periodic_clean()
            except redis.RedisError as exc:
                log.warning("registry maintenance failed: %s", exc)
            except Exception:  # the thread must outlive any one failure
                log.exception("registry maintenance failed")
