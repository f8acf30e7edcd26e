"""The worker's core: an in-process RQ worker that keeps one engine loaded.

`workers.process.worker.RolloutWorker` adds fault handling on top; that is the class to run.

RQ's forking worker would reload the engine per job, so this builds on `SimpleWorker`, which
never refreshes its heartbeat while a job runs; a heartbeat thread does (`maintain_heartbeats`)
and also keeps this worker's registry entry fresh, so a long batch is never declared
abandoned and `pipeline status` always shows the worker. It also puts each running job back in
RQ's started registry should a Redis failover have lost its entry (`rq_seam.reassert_started`),
so that a job a live worker holds is never taken for orphaned (`workers.jobs.reconcile`).

The control channel (`workers.process.control_follower`, DESIGN.md "Control channel"): a listener thread
re-reads the desired state on every wake-up and loads pushed weights while no batch runs
(the engine lock keeps loads and batches apart); the work loop re-reads it before every job,
hands a job dequeued while paused back to the front of its queue, and waits until resumed.

Feeding (`workers.jobs.feeder`): with an engine that has the concurrent interface (sim,
sglang-http) `execute_job` submits the job and returns once the engine has room, so the next
job's requests reach the engine while this one's last sequences finish; each job still gets
its own shard, commit, heartbeats and RQ result. A weight load drains every job in flight
first (`Gate`); a pause stops admissions and lets the jobs in flight finish. A push in
`partial` mode on an engine that can interrupt does not drain: the feeder stops the samples in
flight, loads, and continues them on the new weights (`Feeder.partial_swap`); an engine that
cannot interrupt drains instead, and its acknowledgement says `mode: drain`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Literal

import redis
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.job import Job, Retry
from rq.serializers import JSONSerializer

from pipeline.broker import control_channel as pipeline_control
from pipeline.broker import keys, registry
from pipeline.errors import WriteLostError
from schemas.control import DesiredState, SwapMode, WeightAck
from schemas.worker_info import WorkerInfo, WorkerState
from workers.engines.base import Engine, is_concurrent
from workers.errors import WeightsRefusedError
from workers.jobs import admission, rq_seam
from workers.jobs.allowed_job import RolloutJob
from workers.jobs.feeder import DEFAULT_MAX_JOBS_IN_FLIGHT, Feeder, Gate
from workers.process import context, control_follower, logs
from workers.process.metrics import DEFAULT_METRICS_HOST, WorkerMetrics, queue_wait_s

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineWorker(SimpleWorker):
    """A `SimpleWorker` with a heartbeat thread, a registry entry and a loaded engine."""

    def __init__(
        self,
        conn: redis.Redis,
        engine: Engine,
        *,
        worker_id: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        control_poll_s: float = control_follower.POLL_S,
        feed: bool = True,
        max_jobs_in_flight: int = DEFAULT_MAX_JOBS_IN_FLIGHT,
        feed_headroom: int | None = None,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_METRICS_HOST,
        pool: str | None = None,
        **kwargs: Any,
    ) -> None:
        worker_id = worker_id or new_worker_id()
        self.pool = keys.pool(pool)
        queue = Queue(self.pool.queue_name, connection=conn, serializer=JSONSerializer)
        kwargs.setdefault("job_monitoring_interval", max(1, int(heartbeat_interval_s)))
        super().__init__(
            [queue],
            connection=conn,
            name=worker_id,
            serializer=JSONSerializer,
            job_class=RolloutJob,
            **kwargs,
        )
        self.worker_id = worker_id
        self.engine = engine
        self.heartbeat_interval_s = heartbeat_interval_s
        description = engine.description
        now = time.time()
        self.info = WorkerInfo(
            worker_id=worker_id,
            pool=self.pool.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            engine=description.name,
            model=description.model,
            weight_version=engine.weight_version,
            capabilities=description.served,
            started_at=now,
            heartbeat_at=now,
        )
        # Prometheus metrics (`workers.process.metrics`); served on `metrics_port` when given (0: a free port).
        self.metrics = WorkerMetrics(worker_id, description.name)
        self.metrics.set_weight_version(engine.weight_version)
        self._inflight: dict[str, tuple[Job, Execution]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        # Control channel: the gate keeps weight loads and batches apart (a load drains first);
        # the control lock serialises control handling between the listener and the work loop.
        self.gate = Gate()
        self._control_lock = threading.RLock()
        self._desired = DesiredState()
        self._refused_generation: int | None = None
        self._followed: bytes | None = None  # the stored record of the state followed (as read)
        # What the engine serves (version, path; no path: as it started), and the last load tried
        # (target and generation: a failed load is retried at the next change of the state).
        self._loaded: tuple[int, str | None] = (engine.weight_version, None)
        self._attempted: tuple[int, str | None, int] = (engine.weight_version, None, 0)
        self._last_ack: WeightAck | None = None
        self._weight_error: str | None = None
        self._refused: set[str] = set()  # jobs handed back for their min_weight_version (burst mode)
        self._passed: set[str] = set()  # jobs handed back since the last one run: this worker cannot serve them
        self._changed = threading.Event()
        self._joined = True  # False while `work` loads the pool's weights before joining
        self._listener = control_follower.ControlListener(conn, self.pool.control_channel, self._on_wake,
                                                 poll_s=control_poll_s)
        self.feeder: Feeder | None = None
        if feed and is_concurrent(engine):
            self.feeder = Feeder(self, engine, max_jobs_in_flight=max_jobs_in_flight,  # type: ignore[arg-type]
                                 headroom=feed_headroom)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_host)

    @property
    def _busy(self) -> bool:
        return bool(self._inflight)

    def track(self, job: Job, execution: Execution) -> None:
        """A job is in flight: heartbeats for it, and the registry says busy."""
        self._inflight[job.id] = (job, execution)
        self.metrics.job_started(queue_wait_s(job))
        self.set_registry_state("busy", next(iter(self._inflight), job.id))

    def untrack(self, job: Job) -> None:
        self._inflight.pop(job.id, None)
        if self._inflight:
            self.set_registry_state("busy", next(iter(self._inflight), None))
        else:
            self.set_registry_state(self._resting_state())

    # -- registry and heartbeats ----------------------------------------------------------------

    def set_registry_state(self, state: WorkerState, current_job: str | None = None) -> None:
        with self._lock:
            self.info.state = state
            self.info.current_job = current_job
            self.info.weight_version = self.engine.weight_version
            self.info.error = self._weight_error
        self.metrics.set_state(state)
        self.metrics.set_weight_version(self.info.weight_version)
        self._publish()

    def _publish(self) -> None:
        if not self._joined:  # loading the pool's weights before joining: not a member yet
            return
        try:
            with self._lock:
                registry.publish(self.connection, self.info, ttl_s=int(self.heartbeat_interval_s * 3) + 1)
        except redis.RedisError as exc:
            log.warning("registry heartbeat failed: %s", exc)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            self._publish()
            for job, execution in list(self._inflight.values()):
                try:
                    self.maintain_heartbeats(job, execution)
                    rq_seam.reassert_started(self.connection, job, execution, self.get_heartbeat_ttl(job))
                except redis.RedisError as exc:
                    log.warning("job heartbeat failed: %s", exc)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # The heartbeat thread refreshes every interval: a dead worker's job is noticed quickly
        # instead of after the job timeout as in SimpleWorker.
        return max(2, int(self.heartbeat_interval_s * 3) + 1)

    # -- control channel ------------------------------------------------------------------------

    def _resting_state(self) -> WorkerState:
        if self._desired.paused:
            return "paused"
        return "unhealthy" if self._behind(self._desired) else "idle"

    def _behind(self, state: DesiredState) -> bool:
        """Whether the engine does not serve the pool's desired weights (a load failed or is due)."""
        return state.weight_path is not None and self._loaded != (state.weight_version, state.weight_path)

    def _on_wake(self) -> None:
        """A control wake-up (or the listener's poll): follow the desired state, abort canceled jobs."""
        self.sync_control()
        if self.feeder is not None and self.feeder.in_flight:
            aborted = self.feeder.abort_canceled()
            if aborted:
                log.info("worker %s: aborted %d canceled job(s) in flight", self.worker_id, aborted)

    def sync_control(self) -> DesiredState:
        """Re-read the desired state; load pushed weights if they changed; refresh the registry.

        Called by the listener thread on every wake-up and by the work loop before every job;
        a load first drains every batch in flight, so weights only ever change between batches.
        """
        try:
            raw = self.connection.get(self.pool.control_state)
            state = pipeline_control.parse_state(raw, self.pool.name)
        except (redis.RedisError, pipeline_control.ControlAuthError) as exc:  # forged/unsigned: refused, logged
            log.warning("control state unreadable (%s); keeping %s", exc, self._desired)
            return self._desired
        with self._control_lock:
            if state.generation < self.info.control_generation:
                # Older than one already followed: a replayed record (signed states can be copied),
                # Redis restored from an old snapshot, or a failover that lost the newer one. The
                # record followed is written back (`restore_state`), so Redis and workers agree.
                if state.generation != self._refused_generation:
                    self._refused_generation = state.generation
                    log.warning("control state of generation %d refused: generation %d was already applied "
                                "(a replayed or restored record, or one a Redis failover lost?); keeping %s and "
                                "writing it back", state.generation, self.info.control_generation, self._desired)
                    self._restore_followed()
                return self._desired
            self._desired = state
            self._followed = raw
            with self._lock:
                self.info.control_generation = state.generation
            try:
                if not self._behind(state):
                    self._weight_error = None  # loaded, or a push no worker took was undone
                if state.weight_path is not None and self._behind(state) and \
                        (state.weight_version, state.weight_path, state.generation) != self._attempted:
                    # Due, or failed before and the state changed since (a --force re-push retries).
                    self._swap(state.weight_path, state.weight_version, state.swap_mode, state.generation)
                elif self._last_ack is not None and self._last_ack.version == state.weight_version:
                    # Acks lost (Redis restarted, or a forced re-push of the same weights): answer again.
                    control_follower.write_ack(self.connection, self._last_ack, self.pool.name, only_if_missing=True)
            except (redis.RedisError, WriteLostError) as exc:  # acked again at the next read of the state
                log.warning("control acknowledgement failed: %s", exc)
            if not self._busy:
                self.set_registry_state(self._resting_state())
        self._changed.set()
        return state

    def _restore_followed(self) -> None:
        """Write the state record this worker follows back to Redis, where an older one stands."""
        if self._followed is None:
            return
        try:
            pipeline_control.restore_state(self.connection, self._followed, self.pool.name)
        except (redis.RedisError, WriteLostError) as exc:
            log.warning("writing the control state back failed (%s); retried at the next read", exc)
            self._refused_generation = None

    def _swap(self, path: str, version: int, mode: SwapMode, generation: int) -> None:
        """Load pushed weights: partially (samples in flight continue on them) or after a drain."""
        feeder = self.feeder
        if mode == "partial" and feeder is not None and feeder.can_interrupt:
            stopped = feeder.partial_swap(lambda: self._load_weights(path, version, "partial", generation))
            log.info("worker %s: partial swap to v%d: %d sample(s) stopped and continued",
                     self.worker_id, version, stopped)
            return
        if mode == "partial":
            log.warning("worker %s: partial swap asked, but the %s engine%s cannot stop samples in flight; "
                        "draining instead", self.worker_id, self.engine.description.name,
                        "" if feeder is not None else " (not fed: --no-feed or not concurrent)")
        with self.gate.exclusive():
            self._load_weights(path, version, "drain", generation)

    def _load_weights(self, path: str, version: int, mode: SwapMode, generation: int) -> None:
        self._attempted = (version, path, generation)
        self.set_registry_state("updating")
        log.info("worker %s: loading weights v%d from %s (%s)", self.worker_id, version, path, mode)
        ack = control_follower.load_weights(self.engine, self.worker_id, path, version, mode)
        if ack.ok:
            self._weight_error = None
            self._loaded = (version, path)
            log.info("worker %s: serving weights v%d (%.2f s)", self.worker_id, version, ack.seconds)
        else:
            self._weight_error = f"loading weights v{version} from {path} failed: {ack.error}"
            log.error("worker %s: %s; taking no job until it loads the pool's weights (retried at the next "
                      "push, e.g. `pipeline weights push --force`)", self.worker_id, self._weight_error)
        self._last_ack = ack
        # The registry shows the version served before the ack says so: whoever waits on the ack
        # and then reads the registry must see the new version.
        with self._lock:
            self.info.weight_version = self.engine.weight_version
            self.info.error = self._weight_error
        self._publish()
        control_follower.write_ack(self.connection, ack, self.pool.name)

    def _wait_until_resumed(self, burst: bool) -> bool:
        """Block while paused (False in burst mode: the worker then exits instead)."""
        while True:
            self._changed.clear()
            if not self.sync_control().paused:
                return True
            if burst or rq_seam.stop_requested(self):
                return False
            self._changed.wait(self._listener.poll_s)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        while True:
            result = self._dequeue(timeout, max_idle_time)
            if result is not None or self.feeder is None or not self.feeder.in_flight:
                return result
            # Nothing to take now (burst end, pause in burst, idle limit): finish the jobs in
            # flight, then look again, since a failed one may have been queued for a retry.
            self.feeder.drain()
            if rq_seam.stop_requested(self):
                return None

    def _dequeue(self, timeout: int | None, max_idle_time: int | None) -> tuple[Job, Queue] | None:
        burst = timeout is None
        while True:
            if not self._wait_until_resumed(burst):
                return None
            result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            if result is None:
                return None
            job, queue = result
            state = self.sync_control()  # before every job
            if state.paused:
                control_follower.hand_back(self.connection, job, queue, at_front=True)
                log.info("worker %s: paused; job %s handed back", self.worker_id, job.id)
                continue
            route = self._route(job, queue)
            if route == "rounded":  # every job left is one this worker passes over: wait for a change
                if burst:
                    return None
                self._changed.clear()
                self._changed.wait(self._listener.poll_s)
                continue
            if route != "run":
                continue
            refusal = self._version_refusal(job, state)
            if refusal is not None:
                control_follower.hand_back(self.connection, job, queue, at_front=False)
                log.info("worker %s: job %s handed back: %s", self.worker_id, job.id, refusal)
                if burst:
                    # Serve what else is queued; stop once the refused jobs are all that is left.
                    if job.id in self._refused:
                        return None
                    self._refused.add(job.id)
                    continue
                self._changed.clear()
                self._changed.wait(self._listener.poll_s)
                continue
            return result

    def _version_refusal(self, job: Job, state: DesiredState) -> str | None:
        """Why this worker must not serve `job` at the weights it serves now, or None.

        A job runs at the pool's desired weights or newer; only a job naming its own
        `min_weight_version` may run on older ones (at that version or newer)."""
        served = self.engine.weight_version
        needed = control_follower.min_weight_version(job)
        if needed is not None and served < needed:
            return f"it needs weights v{needed}, serving v{served} ({self._weight_error or 'not pushed yet'})"
        if needed is None and self._behind(state):
            return (f"the pool serves weights v{state.weight_version}, this worker v{served} "
                    f"({self._weight_error or 'not loaded yet'})")
        return None

    def _route(self, job: Job, queue: Queue) -> Literal["run", "passed", "failed", "rounded"]:
        """Whether this worker runs `job` (`workers.jobs.admission`); if not, the job is handed back to the
        end of the queue ("passed"; "rounded" when passed over before since the last job run: the
        worker has been round the queue) or failed ("failed"), nothing ran."""
        verdict = admission.decide(self.connection, job, self.worker_id, self.info.capabilities, self.pool.name)
        if verdict.action == "run":
            self._passed.clear()
            return "run"
        if verdict.action == "fail":
            log.warning("worker %s: failing job %s, nothing ran: %s", self.worker_id, job.id, verdict.reason)
            admission.fail(self, job, queue, self.pool.name, verdict.reason)
            self.metrics.job_failed()
            return "failed"
        control_follower.hand_back(self.connection, job, queue, at_front=False)
        log.info("worker %s: job %s handed back: %s", self.worker_id, job.id, verdict.reason)
        if job.id not in self._passed:
            self._passed.add(job.id)
            return "passed"
        self._passed.clear()
        return "rounded"

    def execute_job(self, job: Job, queue: Queue) -> None:
        feeder = self.feeder
        if feeder is not None and feeder.accepts(job):
            feeder.admit(job, queue)
            feeder.wait_for_room(lambda: rq_seam.stop_requested(self))
            return
        self.gate.enter()
        try:
            with logs.job_scope(job, self.worker_id):
                execution = self.prepare_execution(job)
                self.track(job, execution)
                try:
                    self.perform_job(job, queue, execution)
                finally:
                    self.untrack(job)
        finally:
            self.gate.leave()
        self.set_state("idle")

    def _finalize_success(self, job: Job, queue: Queue, execution: Execution, return_value: Any) -> None:
        super()._finalize_success(job, queue, execution, return_value)
        if not isinstance(return_value, Retry):
            self.metrics.job_finished(return_value)

    # -- lifecycle --------------------------------------------------------------------------

    def _join(self) -> None:
        """Load the pool's desired weights before the first job; refuse to join if they do not load
        (another model's checkpoint, mismatched parameters, a path this host cannot read): rows at
        this engine's own version would mean something else than the pool's."""
        state = self.sync_control()
        if not self._behind(state):
            return
        raise WeightsRefusedError(
            f"worker {self.worker_id} ({self.engine.description.name} engine, model "
            f"{self.engine.description.model}) does not join pool {self.pool.name!r}: the pool serves weights "
            f"v{state.weight_version} from {state.weight_path} and this engine cannot load them: "
            f"{self._weight_error or 'not loaded'}. Start it with a model that takes that checkpoint, in another "
            "--pool, or push weights every worker of the pool loads (`pipeline weights push PATH --version N "
            "--force`)"
        )

    def work(self, *args: Any, **kwargs: Any) -> bool:
        context.install(context.WorkerContext(worker_id=self.worker_id, engine=self.engine))
        self._joined = False
        try:
            self._join()
        except BaseException:
            context.uninstall()
            raise
        self._joined = True
        self.set_registry_state("idle")
        self._thread.start()
        self._listener.start()
        if self.feeder is not None:
            self.feeder.start()
        try:
            return super().work(*args, **kwargs)
        finally:
            if self.feeder is not None:
                try:
                    self.feeder.drain()  # warm shutdown: the jobs in flight finish and commit
                except BaseException:  # a second signal: abort them rather than leave them running
                    self.feeder.abort_all()
                    self.feeder.drain(timeout=10)
                    raise
                finally:
                    self.feeder.stop()
            self._listener.stop()
            self._stop.set()
            self._thread.join(timeout=5)
            registry.remove(self.connection, self.worker_id, self.pool.name)
            context.uninstall()
