"""Job intake: which of the jobs a worker dequeues it runs, and what happens to the others.

Every dequeued job passes three checks before anything runs, and a job that fails one goes back
to its queue untouched (`workers.jobs.handback.hand_back_dequeued`: no retry spent):

- the pool is paused (read again after the dequeue, docs/design.md "Control channel": RQ's own
  suspend lets a worker blocked in its dequeue take one more job): back to the front;
- the worker cannot serve what the job needs (`workers.jobs.admission`): back to the end for
  another worker, or failed when no live worker can serve it for too long. A worker that has
  passed over every job left ("rounded" the queue) waits for a change before it looks again;
- the job needs newer weights than the engine serves (its `min_weight_version`, else the pool's
  desired weights): back to the end until the worker has loaded them.

When nothing is left to take while jobs are still in flight (a burst worker's end, a pause in
burst mode), intake waits for them, then looks again: a failed one may have been queued for a retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import redis
from rq import Queue
from rq.job import Job

from pipeline.core.broker import keys
from schemas.control import DesiredState
from schemas.worker_info import Capabilities
from workers.engines.base import Engine
from workers.jobs import admission
from workers.jobs.feeder import Feeder
from workers.jobs.handback import hand_back_dequeued
from workers.process.control_follower import ControlFollower
from workers.process.metrics import WorkerMetrics

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2  # how often a worker finishing its jobs in flight looks for work queued meanwhile

Dequeued = tuple[Job, Queue]
Route = Literal["run", "passed", "failed", "rounded"]


def min_weight_version(job: Job) -> int | None:
    """The job payload's `min_weight_version`, if any (None for anything unreadable)."""
    try:
        payload = job.args[0] if job.args else None
    except Exception:  # an unreadable job fails later, in the job itself
        return None
    value = payload.get("min_weight_version") if isinstance(payload, dict) else None
    return value if isinstance(value, int) else None


class JobIntake:
    """The jobs `worker_id` (serving `capabilities` on `engine`, in `pool`) takes from RQ's dequeue.

    `fail(job, queue, reason)` fails a dequeued job that no live worker can serve (nothing ran)."""

    def __init__(
        self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, capabilities: Capabilities, engine: Engine,
        control: ControlFollower, feeder: Feeder, metrics: WorkerMetrics, *, fail: Callable[[Job, Queue, str], None],
    ) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.capabilities = capabilities
        self.engine = engine
        self.control = control
        self.feeder = feeder
        self.metrics = metrics
        self.fail = fail
        self._refused: set[str] = set()  # jobs handed back for their min_weight_version (burst mode)
        self._passed: set[str] = set()  # jobs handed back since the last one run: this worker cannot serve them

    def dequeue(self, rq_dequeue: Callable[[], Dequeued | None], *, burst: bool,
                stopping: Callable[[], bool]) -> Dequeued | None:
        """The next job to run, from `rq_dequeue` (RQ's own); None: the worker's loop ends."""
        while True:
            result = self._next(rq_dequeue, burst, stopping)
            if result is not None or not self.feeder.in_flight:
                return result
            # Nothing to take now (burst end, pause in burst, idle limit): finish the jobs in
            # flight, then look again, since a failed one may have been queued for a retry. Work
            # queued meanwhile is taken at once: waiting for the last job in flight (a long
            # sample's tail) with jobs queued left the engine idle, in `rl_loop.py` half the time.
            while not self.feeder.drain(timeout=DRAIN_POLL_S):
                if stopping() or self._work_queued():
                    break
            if stopping():
                return None

    def _work_queued(self) -> bool:
        """Whether the pool's batch queue holds a job (agent turns come through the turn reader)."""
        try:
            return bool(self.conn.llen(f"{Queue.redis_queue_namespace_prefix}{self.pool.queue_name}"))
        except redis.RedisError:
            return False

    def _next(self, rq_dequeue: Callable[[], Dequeued | None], burst: bool,
              stopping: Callable[[], bool]) -> Dequeued | None:
        while True:
            if not self.control.wait_until_resumed(burst=burst, stopping=stopping):
                return None
            result = rq_dequeue()
            if result is None:
                return None
            job, queue = result
            state = self.control.sync()  # before every job
            if state.paused:
                hand_back_dequeued(self.conn, job, queue, at_front=True)
                log.info("worker %s: paused; job %s handed back", self.worker_id, job.id)
                continue
            route = self.route(job, queue)
            if route == "rounded":  # every job left is one this worker passes over: wait for a change
                if burst:
                    return None
                self.control.wait_for_change()
                continue
            if route != "run":
                continue
            refusal = self.version_refusal(job, state)
            if refusal is not None:
                hand_back_dequeued(self.conn, job, queue, at_front=False)
                log.info("worker %s: job %s handed back: %s", self.worker_id, job.id, refusal)
                if burst:
                    # Serve what else is queued; stop once the refused jobs are all that is left.
                    if job.id in self._refused:
                        return None
                    self._refused.add(job.id)
                    continue
                self.control.wait_for_change()
                continue
            return result

    def version_refusal(self, job: Job, state: DesiredState) -> str | None:
        """Why this worker must not serve `job` at the weights it serves now, or None.

        A job runs at the pool's desired weights or newer; only a job naming its own
        `min_weight_version` may run on older ones (at that version or newer)."""
        served = self.engine.weight_version
        needed = min_weight_version(job)
        error = self.control.weight_error
        if needed is not None and served < needed:
            return f"it needs weights v{needed}, serving v{served} ({error or 'not pushed yet'})"
        if needed is None and self.control.behind(state):
            return (f"the pool serves weights v{state.weight_version}, this worker v{served} "
                    f"({error or 'not loaded yet'})")
        return None

    def route(self, job: Job, queue: Queue) -> Route:
        """Whether this worker runs `job` (`workers.jobs.admission`); if not, the job is handed back to the
        end of the queue ("passed"; "rounded" when passed over before since the last job run: the
        worker has been round the queue) or failed ("failed"), nothing ran."""
        verdict = admission.decide(self.conn, job, self.worker_id, self.capabilities, self.pool.name)
        if verdict.action == "run":
            self._passed.clear()
            return "run"
        if verdict.action == "fail":
            log.warning("worker %s: failing job %s, nothing ran: %s", self.worker_id, job.id, verdict.reason)
            self.fail(job, queue, verdict.reason)
            self.metrics.job_failed()
            return "failed"
        hand_back_dequeued(self.conn, job, queue, at_front=False)
        log.info("worker %s: job %s handed back: %s", self.worker_id, job.id, verdict.reason)
        if job.id not in self._passed:
            self._passed.add(job.id)
            return "passed"
        self._passed.clear()
        return "rounded"
