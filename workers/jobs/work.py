"""What the feeder runs: a `Work`, a job with its own records kept by itself. Two kinds exist: a job
trainers submitted, with RQ's records (`RqWork`), and a job of agent turns from a worker's turn queue,
with its stream entry (`workers.process.turn_work.TurnWork`). The feeder runs both the same way and
calls their ends; neither is dressed up as the other.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Protocol

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from pipeline.core.jobs.rq_seam import WorkerBookkeeping

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


class Work(Protocol):
    """A job the feeder runs, and its records."""

    @property
    def id(self) -> str: ...

    @property
    def payload(self) -> Any:
        """Its payload as queued, unchecked (None when it cannot be read): for logs and metrics."""
        ...

    @property
    def enqueued_at(self) -> datetime | None: ...

    @property
    def ran_before(self) -> bool:
        """Whether an earlier run of it may have left a checkpoint."""
        ...

    def open(self) -> None:
        """This worker's record that it holds the job (before anything of it can fail)."""
        ...

    def start(self) -> tuple[dict[str, Any], int]:
        """The job starts: its payload, checked as the project's own (`NotAllowedJobError`), and its
        timeout in seconds (none when not positive)."""
        ...

    def finish(self, exc_info: ExcInfo | None, result: Any) -> None:
        """Its end: success with `result` when `exc_info` is None, else failure (retries, hand-backs)."""
        ...


class RqWork:
    """A job of the pool's RQ queues, its records RQ's (`pipeline.core.jobs.rq_seam.WorkerBookkeeping`)."""

    def __init__(self, job: Job, queue: Queue, bookkeeping: WorkerBookkeeping) -> None:
        self.job = job
        self.queue = queue
        self.bookkeeping = bookkeeping
        self.execution: Execution | None = None

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def payload(self) -> Any:
        try:
            return self.job.args[0] if self.job.args else None
        except Exception:  # unreadable arguments: the job fails on its own path
            return None

    @property
    def enqueued_at(self) -> datetime | None:
        enqueued = self.job.enqueued_at
        if isinstance(enqueued, datetime) and enqueued.tzinfo is None:
            return enqueued.replace(tzinfo=UTC)
        return enqueued

    @property
    def ran_before(self) -> bool:
        return True  # RQ does not say: its checkpoint is looked for

    def open(self) -> None:
        self.execution = self.bookkeeping.open(self.job)

    def start(self) -> tuple[dict[str, Any], int]:
        timeout = self.bookkeeping.start(self.job)
        self.job.func  # noqa: B018 - the job class refuses any function but the project's own
        return self.job.args[0], timeout

    def finish(self, exc_info: ExcInfo | None, result: Any) -> None:
        assert self.execution is not None
        self.bookkeeping.finish(self.job, self.queue, self.execution, exc_info, result)
