"""A worker's presence: its registry entry and the heartbeats of its jobs in flight.

RQ's `SimpleWorker` never refreshes a job's heartbeat while the job runs, so a long batch would
be declared abandoned and run twice. One thread here refreshes, every interval: the worker's
entry in the pool's registry (`pipeline.core.broker.registry`, TTL three intervals, so `pipeline
status` always shows a live worker), RQ's heartbeat of every job in flight, and each such job's
entry in its queue's started registry should a Redis failover have lost it
(`rq_seam.reassert_started`), so that a job a live worker holds is never taken for orphaned
(`workers.jobs.reconcile`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq.executions import Execution
from rq.job import Job

from pipeline.core.broker import registry
from pipeline.core.jobs import rq_seam
from schemas.worker_info import WorkerInfo
from workers.engines.adapters.cache import serves_adapters
from workers.engines.base import Engine

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 5


def worker_info(worker_id: str, pool: str, engine: Engine) -> WorkerInfo:
    """The registry entry of a worker starting around `engine`."""
    description = engine.description
    now = time.time()
    return WorkerInfo(
        worker_id=worker_id,
        pool=pool,
        host=socket.gethostname(),
        pid=os.getpid(),
        engine=description.name,
        model=description.model,
        weight_version=engine.weight_version,
        capabilities=description.served.model_copy(update={"lora_adapters": serves_adapters(engine)}),
        started_at=now,
        heartbeat_at=now,
    )


class Heartbeat:
    """`info` published in the registry, and `jobs()` kept alive in RQ, every `interval_s`.

    `beat_job(job, execution)` refreshes one job's RQ heartbeat (the worker's `maintain_heartbeats`).
    Nothing is published while `joined` is False (a worker loading its pool's weights before it
    joins is not a member yet)."""

    def __init__(
        self, conn: redis.Redis, info: WorkerInfo, *, interval_s: float,
        jobs: Callable[[], list[tuple[Job, Execution]]], beat_job: Callable[[Job, Execution], Any],
    ) -> None:
        self.conn = conn
        self.info = info
        self.interval_s = interval_s
        self.jobs = jobs
        self.beat_job = beat_job
        self.joined = True
        self._member = False  # in the pool's set of workers since a full publish
        # Held around every change and publish of `info`; reentrant, so that a caller can compute
        # and publish a state as one step.
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    @property
    def job_ttl(self) -> int:
        """A job's heartbeat TTL: a dead worker's job is noticed within three intervals, instead of
        after the job timeout as in `SimpleWorker`."""
        return max(2, int(self.interval_s * 3) + 1)

    def update(self, **fields: Any) -> None:
        """Set fields of the entry and publish it if any changed (the entry alone: one command; the
        heartbeat refreshes the pool's membership)."""
        with self.lock:
            changed = any(getattr(self.info, name) != value for name, value in fields.items())
            for name, value in fields.items():
                setattr(self.info, name, value)
            if changed or not self._member:
                self.publish(membership=not self._member)

    def publish(self, *, membership: bool = True) -> None:
        if not self.joined:
            return
        try:
            with self.lock:
                registry.publish(self.conn, self.info, ttl_s=int(self.interval_s * 3) + 1, membership=membership)
                self._member = self._member or membership
        except redis.RedisError as exc:
            log.warning("registry heartbeat failed: %s", exc)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take the entry out of the registry."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._member = False
        registry.remove(self.conn, self.info.worker_id, self.info.pool)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()
            for job, execution in self.jobs():
                try:
                    self.beat_job(job, execution)
                    rq_seam.reassert_started(self.conn, job, execution, self.job_ttl)
                except redis.RedisError as exc:
                    log.warning("job heartbeat failed: %s", exc)
