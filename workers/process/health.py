"""Engine health: a worker whose engine fails stops taking jobs until a probe says it is back.

When a job fails because the engine is unreachable or keeps failing
(`EngineUnavailableError`, which the SGLang adapters raise after their own retries), the
fault is the worker's, not the job's: the job is handed back for another worker, the worker
marks itself `unhealthy` in the registry (with the reason) and stops dequeuing. It probes
the engine with backoff (`engine.health()` when the adapter has one, e.g. SGLang's
`/health_generate`; otherwise it simply waits out the backoff) and resumes when the probe passes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from workers.errors import EngineUnavailableError
from workers.process.metrics import WorkerMetrics

log = logging.getLogger(__name__)

PROBE_INITIAL_S = 0.5
PROBE_MAX_S = 30.0


def is_engine_failure(exc: BaseException | None) -> bool:
    """Whether a job's exception says the engine (not the job) is at fault."""
    return isinstance(exc, EngineUnavailableError | ConnectionRefusedError)


def probe(engine: Any) -> str | None:
    """None when the engine answers its health check, else why not (engines without one pass)."""
    check = getattr(engine, "health", None)
    if check is None:
        return None
    try:
        check()
    except Exception as exc:  # any failure of the probe means: not yet
        return f"{type(exc).__name__}: {exc}"
    return None


class EngineHealth:
    """One worker's engine: healthy, or `reason` it is not; `wait` blocks dequeuing while it is down."""

    def __init__(
        self, engine: Any, metrics: WorkerMetrics, *, worker_name: str,
        probe_initial_s: float = PROBE_INITIAL_S, probe_max_s: float = PROBE_MAX_S,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.worker_name = worker_name
        self.probe_max_s = probe_max_s
        self.probe_initial_s = min(probe_initial_s, probe_max_s)
        self.reason: str | None = None

    def job_failed(self, exc: BaseException | None) -> str | None:
        """Why the failed job must be handed back for an engine failure (now unhealthy), or None."""
        if not is_engine_failure(exc):
            return None
        self.metrics.engine_error("job")
        self.reason = f"engine failed: {exc}"[:1000]
        return self.reason

    def wait(
        self, *, burst: bool, stopping: Callable[[], bool], report: Callable[[], None],
        keepalive: Callable[[], None],
    ) -> bool:
        """Block while unhealthy, probing with backoff; False when the worker should stop instead.

        `report` publishes the worker's state after each change of `reason`; `keepalive` refreshes
        the worker's RQ heartbeat between probes; `stopping` says a shutdown was requested.
        """
        delay = self.probe_initial_s
        announced = False
        while self.reason is not None:
            if not announced:
                log.error("worker %s: unhealthy (%s); not taking jobs until the engine answers",
                          self.worker_name, self.reason)
                report()
                announced = True
            if stopping():
                return False
            time.sleep(delay)
            problem = probe(self.engine)
            if problem is None:
                log.warning("worker %s: engine healthy again; taking jobs", self.worker_name)
                self.reason = None
                report()
                return True
            self.reason = f"engine failed; health probe: {problem}"[:1000]
            self.metrics.engine_error("probe")
            report()
            if burst:
                return False
            try:
                keepalive()
            except Exception as exc:  # Redis trouble is the dequeue loop's to handle
                log.warning("worker heartbeat failed: %s", exc)
            delay = min(delay * 2, self.probe_max_s)
        return True
