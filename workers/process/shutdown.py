"""SIGTERM/SIGINT handling: the first signal is a warm shutdown, the second hands the jobs back.

RQ's first signal already means "finish the job in hand, then exit" (the commit included): the
worker stops dequeuing and waits for its jobs in flight (`EngineWorker.work`). RQ's second
signal would raise `SystemExit` wherever the main thread is, and a failing job would spend a
retry on an operator's decision. Here the second signal (more than a second after the first,
as in RQ) only marks the shutdown aborting: the worker's wait for its jobs sees it, aborts
them in the engine, and every job that fails from then on is handed back to the front of its
queue, untouched by the retry count, for another worker; then the worker exits. Nothing is
raised into the main thread while jobs are in flight, so a second signal landing anywhere in
the shutdown sequence (not only in that wait) still aborts and hands back every job. With no
job in flight the second signal exits at once.

Redis gone: every command retries for `PIPELINE_REDIS_RECONNECT_S` (60 s) while Redis is
unreachable, so that a worker rides out a restart or a failover. A worker told to stop does not
wait that out: from the first signal on, a command that cannot reach Redis gives up
`PIPELINE_STOPPING_RECONNECT_S` (5 s) later, and from the second at once; the shutdown's own Redis writes (the
commit of a job in flight, the registry entry, the turn log's flush) are then skipped with a
warning, and the worker exits. A job whose commit was skipped is not lost: its lease expires and
another worker runs it again (one shard, as for a worker that died).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from rq.utils import now

log = logging.getLogger(__name__)

class Shutdown:
    """The second shutdown signal of one worker, and which failing jobs it hands back."""

    def __init__(self, worker_name: str) -> None:
        self.worker_name = worker_name
        self.aborting = False
        self.exiting = False  # a second signal with no job in flight: exit now (1), whatever follows
        self.signal = "SIGTERM"  # the second signal's name, for the hand-back reason

    @staticmethod
    def is_repeat(first_signal_at: datetime | None) -> bool:
        """The same signal delivered twice within a second (process group and pool): ignored, as RQ does."""
        return first_signal_at is not None and now() - first_signal_at < timedelta(seconds=1)

    def abort(self, running: list[str], signal_name: str = "SIGTERM") -> None:
        """Second signal: mark the jobs in flight for abort and hand-back (the worker's wait for them
        acts on it), or exit at once when there is none."""
        self.signal = signal_name
        if running:
            self.aborting = True
            log.warning("worker %s: second shutdown signal; aborting %s and handing back",
                        self.worker_name, ", ".join(running))
            return
        log.warning("worker %s: second shutdown signal; exiting now", self.worker_name)
        self.exiting = True
        raise SystemExit(1)

    def handback_reason(self, exc: BaseException | None) -> str | None:
        """Why a job failing now must be handed back after a shutdown abort, or None."""
        if self.aborting:
            return f"the worker was shut down (a second {self.signal}) while running it"
        return None
