"""SIGTERM/SIGINT handling: the first signal is a warm shutdown, the second hands the job back.

RQ's first signal already means "finish the job in hand, then exit" (the commit included).
RQ's second signal raises `SystemExit` inside the job, which the worker would record as a
failure and retry, spending a retry on an operator's decision. Here the second signal
(more than a second after the first, as in RQ) raises `ShutdownAbort` instead; every job
that fails from then on (the one in hand, and with a concurrent engine every other job in
flight, whose requests the worker then aborts) is handed back to the front of its queue,
untouched by the retry count, for another worker, and the worker exits.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from types import FrameType
from typing import Any

from rq.utils import now

log = logging.getLogger(__name__)


class ShutdownAbort(BaseException):
    """Raised inside a running job by the second shutdown signal (not an `Exception`: nothing swallows it)."""


class GracefulShutdownMixin:
    """For an in-process RQ worker: warm shutdown first, abort-and-hand-back second."""

    _aborting: bool = False

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        worker: Any = self
        requested = worker._shutdown_requested_date
        if requested is not None and now() - requested < timedelta(seconds=1):
            return  # the same signal delivered twice (process group and pool), as RQ ignores it
        running = [e.job_id for e in worker.executions.values()]
        worker._stop_requested = True
        if running:
            self._aborting = True
            log.warning("worker %s: second shutdown signal; aborting %s and handing back",
                        worker.name, ", ".join(running))
            raise ShutdownAbort(f"worker {worker.name} shut down while running the job; handed back")
        log.warning("worker %s: second shutdown signal; exiting now", worker.name)
        raise SystemExit(1)

    def shutdown_handback_reason(self, exc: BaseException | None) -> str | None:
        """Why a job failing now must be handed back after a shutdown abort, or None."""
        if isinstance(exc, ShutdownAbort) or self._aborting:
            return "the worker was shut down (second SIGTERM) while running it"
        return None
