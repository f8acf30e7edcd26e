"""A submitted batch: wait for its jobs, see their state, read its rows back."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import redis
from rq.job import Job
from tqdm import tqdm

from pipeline import commit_log
from pipeline.errors import JobsFailedError, WaitTimeoutError
from pipeline.reader import read_rollouts
from pipeline.status import failure_reason
from pipeline.submit import SubmitPlan

TERMINAL = {"finished", "failed", "stopped", "canceled"}


@dataclass
class BatchStatus:
    counts: Counter[str]
    total: int

    @property
    def done(self) -> int:
        return sum(self.counts[s] for s in TERMINAL)

    @property
    def complete(self) -> bool:
        return self.done == self.total


class Batch:
    """Handle on one `submit`: its run, output URL and jobs."""

    def __init__(self, conn: redis.Redis, plan: SubmitPlan) -> None:
        self.conn = conn
        self.plan = plan
        # Rows committed per job, read incrementally from the commit log while waiting.
        self._rows: dict[str, int] = {}
        self._last_entry: str | None = None

    @property
    def run(self) -> str:
        return self.plan.run

    @property
    def output(self) -> str:
        return self.plan.output

    @property
    def job_ids(self) -> list[str]:
        return self.plan.job_ids

    @property
    def url(self) -> str:
        """Where this batch's shards are written."""
        return f"{self.plan.output}/{self.plan.run}"

    def job_states(self) -> dict[str, str]:
        """Each job's RQ status (`missing` when its record expired or was deleted)."""
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in self.job_ids:
                pipe.hget(Job.key_for(job_id), "status")
            raw = pipe.execute()
        return {j: (s.decode() if s else "missing") for j, s in zip(self.job_ids, raw, strict=True)}

    def status(self) -> BatchStatus:
        states = self.job_states()
        return BatchStatus(Counter(states.values()), len(states))

    def failures(self) -> dict[str, str]:
        """Failed jobs with the last line of their error."""
        failed = [j for j, s in self.job_states().items() if s in {"failed", "stopped", "canceled", "missing"}]
        return {job_id: failure_reason(self.conn, job_id) for job_id in failed}

    def wait(self, timeout: float | None = None, *, progress: bool | None = None,
             poll_s: float = 0.2) -> BatchStatus:
        """Block until every job finished; raise `JobsFailedError` naming the failed ones."""
        show = sys.stderr.isatty() if progress is None else progress
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = tqdm(total=len(self.job_ids), unit="job", disable=not show, desc=self.run)
        try:
            while True:
                status = self.status()
                bar.n = status.done
                if show:
                    bar.set_postfix(rows=self._rows_so_far(), failed=status.counts["failed"])
                bar.refresh()
                if status.complete:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise WaitTimeoutError(
                        f"batch of run {self.run}: {status.done}/{status.total} jobs done after "
                        f"{timeout}s ({dict(status.counts)}); are workers running? "
                        "(`pipeline status`)"
                    )
                time.sleep(poll_s)
        finally:
            bar.close()
        if status.counts["finished"] != status.total:
            raise JobsFailedError(self.failures())
        return status

    def commits(self) -> list[commit_log.Commit]:
        ours = set(self.job_ids)
        return [c for c in commit_log.read_all(self.conn, self.run) if c.job_id in ours]

    def _rows_so_far(self) -> int:
        """Committed rows, reading only the commit-log entries appended since the last call."""
        ours = set(self.job_ids)
        for commit in commit_log.read_after(self.conn, self.run, self._last_entry):
            self._last_entry = commit.entry_id
            if commit.job_id in ours:
                self._rows[commit.job_id] = commit.rows
        return sum(self._rows.values())

    def committed_rows(self) -> int:
        return sum(c.rows for c in self.commits())

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """This batch's rows (only its own shards, not the rest of the run)."""
        return read_rollouts([c.url for c in self.commits()], columns=columns)
