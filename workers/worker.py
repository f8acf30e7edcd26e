"""The worker process: an in-process RQ worker that keeps one engine loaded.

RQ's forking worker would reload the engine per job, so this builds on `SimpleWorker`, which
never refreshes its heartbeat while a job runs; a heartbeat thread does (`maintain_heartbeats`)
and also keeps this worker's registry entry fresh, so a long batch is never declared
abandoned and `pipeline status` always shows the worker.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline import keys, registry
from schemas.worker_info import WorkerInfo, WorkerState
from workers import context
from workers.engines.base import Engine
from workers.job_class import RolloutJob

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RolloutWorker(SimpleWorker):
    """A `SimpleWorker` with a heartbeat thread, a registry entry and a loaded engine."""

    def __init__(
        self,
        conn: redis.Redis,
        engine: Engine,
        *,
        worker_id: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        **kwargs: Any,
    ) -> None:
        worker_id = worker_id or new_worker_id()
        queue = Queue(keys.QUEUE_NAME, connection=conn, serializer=JSONSerializer)
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
            host=socket.gethostname(),
            pid=os.getpid(),
            engine=description.name,
            model=description.model,
            weight_version=engine.weight_version,
            capabilities=description.capabilities,
            started_at=now,
            heartbeat_at=now,
        )
        self._running: tuple[Job, Execution] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    # -- registry and heartbeats ----------------------------------------------------------------

    def set_registry_state(self, state: WorkerState, current_job: str | None = None) -> None:
        with self._lock:
            self.info.state = state
            self.info.current_job = current_job
            self.info.weight_version = self.engine.weight_version
        self._publish()

    def _publish(self) -> None:
        try:
            with self._lock:
                registry.publish(self.connection, self.info, ttl_s=int(self.heartbeat_interval_s * 3) + 1)
        except redis.RedisError as exc:
            log.warning("registry heartbeat failed: %s", exc)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            self._publish()
            running = self._running
            if running is not None:
                try:
                    self.maintain_heartbeats(*running)
                except redis.RedisError as exc:
                    log.warning("job heartbeat failed: %s", exc)

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # The heartbeat thread refreshes every interval: a dead worker's job is noticed quickly
        # instead of after the job timeout as in SimpleWorker.
        return max(2, int(self.heartbeat_interval_s * 3) + 1)

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        self._running = (job, execution)
        self.set_registry_state("busy", job.id)
        try:
            self.perform_job(job, queue, execution)
        finally:
            self._running = None
            self.set_registry_state("idle")
        self.set_state("idle")

    # -- lifecycle --------------------------------------------------------------------------

    def work(self, *args: Any, **kwargs: Any) -> bool:
        context.install(context.WorkerContext(worker_id=self.worker_id, engine=self.engine))
        self.set_registry_state("idle")
        self._thread.start()
        try:
            return super().work(*args, **kwargs)
        finally:
            self._stop.set()
            self._thread.join(timeout=5)
            registry.remove(self.connection, self.worker_id)
            context.uninstall()
