"""A submitted batch: wait for its jobs, see their state, read its rows back."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import redis
from rq.results import Result

from pipeline.audit.status import stalled_hint
from pipeline.core.broker import commit_log, keys
from pipeline.core.errors import IncompleteBatchError, JobsFailedError, SubmitLostError, WaitTimeoutError
from pipeline.core.jobs.status import failure_reason, read_status
from pipeline.core.shards import read_rollouts
from pipeline.runs.cancel import CancelResult, cancel
from pipeline.runs.progress import Progress
from pipeline.runs.take import GroupFilter, TakeResult, take
from pipeline.submit.enqueue import SubmitPlan

TERMINAL = {"finished", "failed", "stopped", "canceled"}
# `wait` blocks on the result streams of this many unfinished jobs (and on the commit log).
WATCHED_JOBS = 64
DEFAULT_RECHECK_S = 1.0
MIN_CHECK_S = 0.05
_READ_COUNT = 1000


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

    @property
    def canceled(self) -> int:
        return self.counts["canceled"]


class Batch:
    """Handle on one `submit`: its run, output URL and jobs."""

    def __init__(self, conn: redis.Redis, plan: SubmitPlan) -> None:
        self.conn = conn
        self.plan = plan
        # Rows committed per job, read incrementally from the commit log while waiting.
        self._rows: dict[str, int] = {}
        self._last_entry: str | None = None
        self.last_take: TakeResult | None = None  # the report of the last `take`: kept, dropped, canceled

    def __repr__(self) -> str:
        """What was submitted and where its rows go (no Redis call: `status()` says how far it is)."""
        plan = self.plan
        extra = "".join(f", {name}={value!r}" for name, value in (("reward", plan.reward), ("groups", plan.groups))
                        if value is not None)
        return (f"Batch(run={plan.run!r}, pool={plan.pool!r}, jobs={len(plan.job_ids)}, requests={plan.requests}, "
                f"samples={plan.samples}, url={self.url!r}{extra})")

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

    def job_states(self, job_ids: list[str] | None = None) -> dict[str, str]:
        """Each job's RQ status (`missing` when its record expired or was deleted)."""
        job_ids = self.job_ids if job_ids is None else job_ids
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                read_status(pipe, job_id)
            raw = pipe.execute()
        return {j: (s.decode() if s else "missing") for j, s in zip(job_ids, raw, strict=True)}

    def status(self) -> BatchStatus:
        states = self.job_states()
        return BatchStatus(Counter(states.values()), len(states))

    def failures(self) -> dict[str, str]:
        """Failed jobs with the last line of their error."""
        failed = [j for j, s in self.job_states().items() if s in {"failed", "stopped", "missing"}]
        return {job_id: failure_reason(self.conn, job_id) for job_id in failed}

    def wait(self, timeout: float | None = None, *, progress: bool | None = None,
             poll_s: float = DEFAULT_RECHECK_S) -> BatchStatus:
        """Block until every job finished or was canceled; raise `JobsFailedError` naming the failed ones,
        `SubmitLostError` when the whole batch is gone from Redis (lost with a failed-over master
        after its submit returned; submitting it again duplicates nothing).

        Blocks on Redis (`XREAD BLOCK`) rather than polling: on the run's commit log, which wakes
        it at every commit, and on RQ's result streams of the first `WATCHED_JOBS` unfinished
        jobs, which wake it when one of them finishes or fails. `poll_s` bounds the sleep between
        checks otherwise (a failure of a job not watched yet is seen within it). Only unfinished
        jobs' states are read, at most once per `MIN_CHECK_S` however fast jobs commit.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # A bar on a terminal; `progress=True` elsewhere prints a line at each 10 % instead.
        bar = Progress(len(self.job_ids), self.run, show=sys.stderr.isatty() if progress is None else progress)
        results: dict[str, str] = {}  # job id -> last RQ result entry read
        final: dict[str, str] = {}  # jobs in a terminal state: not asked about again
        caught_up = True
        try:
            while True:
                checked_at = time.monotonic()
                states = {**final, **self.job_states([j for j in self.job_ids if j not in final])}
                final.update((j, s) for j, s in states.items() if s in TERMINAL)
                status = BatchStatus(Counter(states.values()), len(states))
                if status.counts["missing"] == status.total and not self.conn.exists(keys.batch(self.plan.batch_id)):
                    # Enqueued with its record in one transaction: both gone means lost with a Redis master.
                    raise SubmitLostError(self.plan.batch_id, self.run)
                bar.update(status.done, sum(self._rows.values()), status.counts["failed"])
                if status.complete:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimeoutError(
                        f"batch of run {self.run}: {status.done}/{status.total} jobs done after "
                        f"{timeout}s ({dict(status.counts)}); {stalled_hint(self.conn, self.run)}"
                    )
                watched = [j for j, s in states.items() if s not in TERMINAL][:WATCHED_JOBS]
                block_s = poll_s if left is None else min(poll_s, left)
                caught_up = self._block(watched, results, block_ms=max(1, int(block_s * 1000)) if caught_up else None)
                # Many jobs committing at once: check their states at most every MIN_CHECK_S.
                since = time.monotonic() - checked_at
                if caught_up and since < MIN_CHECK_S:
                    time.sleep(MIN_CHECK_S - since)
        finally:
            bar.close()
        if status.counts["finished"] + status.canceled != status.total:
            raise JobsFailedError(self.failures())
        return status

    def _block(self, watched: list[str], results: dict[str, str], *, block_ms: int | None) -> bool:
        """One XREAD on the commit log and the watched jobs' result streams; True when caught up."""
        streams = {keys.commit_log(self.run): self._last_entry or "0-0"}
        for job_id in watched:
            streams[Result.get_key(job_id)] = results.get(job_id, "0-0")
        socket_timeout = self.conn.connection_pool.connection_kwargs.get("socket_timeout")
        if block_ms is not None and socket_timeout:  # a block past the client's read timeout would fail
            block_ms = max(1, min(block_ms, int(socket_timeout * 1000) // 2))
        reply = self.conn.xread(streams, count=_READ_COUNT, block=block_ms)  # type: ignore[arg-type]
        caught_up = True
        ours = set(self.job_ids)
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            caught_up = caught_up and len(entries) < _READ_COUNT
            if name == keys.commit_log(self.run):
                for entry_id, fields in entries:
                    commit = commit_log.Commit.from_fields(entry_id.decode(), fields)
                    self._last_entry = commit.entry_id
                    if commit.job_id in ours:
                        self._rows[commit.job_id] = commit.rows
            elif entries:
                results[name.rsplit(":", 1)[1]] = entries[-1][0].decode()
        return caught_up

    @property
    def reward(self) -> str | None:
        """The batch's reward function, if it was submitted with one."""
        return self.plan.reward

    def take(self, groups: int | None = None, keep: GroupFilter | None = None, *,
             timeout: float | None = None, cancel_rest: bool = True) -> TakeResult:
        """`groups` complete groups (all n samples of a request, rewards joined when the batch has a
        reward function) that `keep` accepts, as jobs finish; then cancel the rest
        (`pipeline.runs.take`; `keep=pipeline.runs.take.rewards_differ` is DAPO's filter)."""
        self.last_take = take(self, groups, keep, timeout=timeout, cancel_rest=cancel_rest)
        return self.last_take

    def cancel(self) -> CancelResult:
        """Cancel this batch's jobs: queued ones are removed, running ones aborted at their engine's
        next step, committed shards stay (`pipeline.runs.cancel`)."""
        return cancel(self.conn, job_ids=self.job_ids)

    def commits(self) -> list[commit_log.Commit]:
        ours = set(self.job_ids)
        return [c for c in commit_log.read_all(self.conn, self.run) if c.job_id in ours]

    def committed_rows(self) -> int:
        return sum(c.rows for c in self.commits())

    def read(self, columns: list[str] | None = None, *, partial: bool = False) -> pa.Table:
        """This batch's rows (only its own shards, not the rest of the run).

        Before every job has ended it raises `IncompleteBatchError` (say how many are done)
        rather than return a part silently; `partial=True` returns the rows committed so far
        (maybe none)."""
        commits = self.commits()
        if not partial and len({c.job_id for c in commits}) < len(self.job_ids):
            status = self.status()
            if not status.complete:
                raise IncompleteBatchError(
                    f"batch of run {self.run!r} is not complete: {status.done} of {status.total} job(s) ended "
                    f"({len({c.job_id for c in commits})} committed); `wait()` first, or `read(partial=True)` "
                    "for the rows committed so far"
                )
        return read_rollouts([c.url for c in commits], columns=columns, missing_ok=True)
