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
import threading
import time
from typing import Any

from workers.errors import EngineUnavailableError

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


class EngineHealthMixin:
    """Tracks the engine's health; `wait_until_healthy` blocks dequeuing while it is down."""

    unhealthy_reason: str | None = None
    probe_initial_s: float = PROBE_INITIAL_S
    probe_max_s: float = PROBE_MAX_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # RQ passes a failing job's exception to handle_exception, then (same thread) calls
        # handle_job_failure without it. Jobs fail on two threads (the work loop, and the
        # feeder's completion thread), so the exception is kept per thread.
        self._failing = threading.local()

    def handle_exception(self, job: Any, *exc_info: Any) -> None:
        self._failing.exception = exc_info[1] if len(exc_info) > 1 else None
        super().handle_exception(job, *exc_info)  # type: ignore[misc]

    def take_job_exception(self) -> BaseException | None:
        """The exception of the job this thread is failing (once)."""
        exc = getattr(self._failing, "exception", None)
        self._failing.exception = None
        return exc

    def health_handback_reason(self, exc: BaseException | None) -> str | None:
        """Why the failed job must be handed back for an engine failure (and mark unhealthy), or None."""
        if not is_engine_failure(exc):
            return None
        worker: Any = self
        worker.metrics.engine_error("job")
        self.unhealthy_reason = f"engine failed: {exc}"[:1000]
        return self.unhealthy_reason

    def wait_until_healthy(self, *, burst: bool) -> bool:
        """Block while unhealthy, probing with backoff; False when the worker should stop instead."""
        worker: Any = self
        delay = self.probe_initial_s
        announced = False
        while self.unhealthy_reason is not None:
            if not announced:
                log.error("worker %s: unhealthy (%s); not taking jobs until the engine answers",
                          worker.name, self.unhealthy_reason)
                worker.set_registry_state("unhealthy")
                announced = True
            if worker._stop_requested:
                return False
            time.sleep(delay)
            problem = probe(worker.engine)
            if problem is None:
                log.warning("worker %s: engine healthy again; taking jobs", worker.name)
                self.unhealthy_reason = None
                worker.set_registry_state(worker._resting_state())
                return True
            self.unhealthy_reason = f"engine failed; health probe: {problem}"[:1000]
            worker.metrics.engine_error("probe")
            worker.set_registry_state("unhealthy")
            if burst:
                return False
            try:
                worker.heartbeat()
            except Exception as exc:  # Redis trouble is the dequeue loop's to handle
                log.warning("worker heartbeat failed: %s", exc)
            delay = min(delay * 2, self.probe_max_s)
        return True
