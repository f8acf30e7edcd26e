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
from datetime import datetime, timedelta

from rq.utils import now

log = logging.getLogger(__name__)


class ShutdownAbort(BaseException):
    """Raised inside a running job by the second shutdown signal (not an `Exception`: nothing swallows it)."""


class Shutdown:
    """The second shutdown signal of one worker, and which failing jobs it hands back."""

    def __init__(self, worker_name: str) -> None:
        self.worker_name = worker_name
        self.aborting = False

    @staticmethod
    def is_repeat(first_signal_at: datetime | None) -> bool:
        """The same signal delivered twice within a second (process group and pool): ignored, as RQ does."""
        return first_signal_at is not None and now() - first_signal_at < timedelta(seconds=1)

    def abort(self, running: list[str]) -> None:
        """Second signal: raise `ShutdownAbort` in the job in hand, or exit at once when there is none."""
        if running:
            self.aborting = True
            log.warning("worker %s: second shutdown signal; aborting %s and handing back",
                        self.worker_name, ", ".join(running))
            raise ShutdownAbort(f"worker {self.worker_name} shut down while running the job; handed back")
        log.warning("worker %s: second shutdown signal; exiting now", self.worker_name)
        raise SystemExit(1)

    def handback_reason(self, exc: BaseException | None) -> str | None:
        """Why a job failing now must be handed back after a shutdown abort, or None."""
        if isinstance(exc, ShutdownAbort) or self.aborting:
            return "the worker was shut down (second SIGTERM) while running it"
        return None
