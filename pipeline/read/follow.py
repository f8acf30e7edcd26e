"""Following a live run: shards as workers commit them, from the run's commit-log stream.

    follower = client.follow(run="step-42", cursor=saved)
    for shard in follower:
        train_on(shard.read())
        save(follower.cursor)          # after the shard is processed: resume from here

With `rewards=True` each shard is held until its rewards are recorded (a run submitted with a
reward function) and `shard.read(rewards=True)` joins them.

The follower blocks on the stream (`XREAD BLOCK`) and ends when every job of the batch (with
`batch_id`) or of every batch submitted to the run has committed, failed or been canceled
(`Follower.canceled`; a canceled job never commits). The cursor is a
stream entry id; a follower started with a saved cursor first re-reads the job ids committed
up to it, so a job id is delivered at most once to one consumer (a retried job that commits
again is skipped), and every commit after the cursor is delivered.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import redis

from pipeline.audit.status import stalled_hint
from pipeline.core.broker import keys, registry
from pipeline.core.broker.commit_log import Commit
from pipeline.core.errors import JobsFailedError, PipelineError, UnknownRunError, WaitTimeoutError
from pipeline.core.jobs.status import read_status
from pipeline.core.shards import read_rollouts
from pipeline.core.suggest import did_you_mean, listing

START = "0-0"
FAILED_STATES = frozenset({"failed", "stopped"})
ENDED_STATES = FAILED_STATES | {"canceled"}
DEFAULT_BLOCK_MS = 1000
_READ_COUNT = 256
_ENTRY_ID = re.compile(r"^\d+-\d+$")

__all__ = ["DEFAULT_BLOCK_MS", "Follower", "Shard"]


@dataclass(frozen=True)
class Shard(Commit):
    """One committed shard, as the commit log recorded it."""

    @property
    def cursor(self) -> str:
        """Its stream entry id: hand it back to resume after this shard."""
        return self.entry_id

    def read(
        self, columns: list[str] | None = None, filter: pads.Expression | None = None, *, rewards: bool = False,
    ) -> pa.Table:
        """The shard's rows (projected and filtered as asked); `rewards` joins `reward` and
        `reward_info` from the rewards shard beside it (null where there is none)."""
        return read_rollouts(self.url, columns=columns, filter=filter, rewards=rewards)


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Follower:
    """An iterator of `Shard`s of one run; `cursor` is the entry id of the last shard returned
    (or of the last entry passed over), to persist and hand back to resume."""

    def __init__(
        self,
        conn: redis.Redis,
        run: str,
        *,
        cursor: str | None = None,
        batch_id: str | None = None,
        block_ms: int = DEFAULT_BLOCK_MS,
        timeout: float | None = None,
        raise_on_failure: bool = True,
        rewards: bool = False,
    ) -> None:
        if block_ms < 1:
            raise PipelineError(f"block_ms must be at least 1 (XREAD BLOCK 0 waits forever), not {block_ms}")
        self.conn = conn
        self.run = run
        self.batch_id = batch_id
        self.block_ms = block_ms
        self.timeout = timeout
        self.raise_on_failure = raise_on_failure
        self.rewards = rewards  # hold each shard until its rewards are recorded (`pipeline.core.broker.reward_log`)
        self.cursor = cursor or START
        self.failed: dict[str, str] = {}
        self.canceled: set[str] = set()  # jobs that ended canceled (`pipeline.runs.cancel`), not failures
        self._stream = keys.commit_log(run)
        self._seen: set[str] = set()
        if not _ENTRY_ID.match(self.cursor):
            raise PipelineError(
                f"cursor {self.cursor!r} is not a stream entry id (like '1767225600000-0'); "
                "pass the `cursor` a follower exposed, or none to start from the beginning"
            )
        if self.cursor != START:
            for _, fields in conn.xrange(self._stream, "-", self.cursor):
                self._seen.add(_decode(fields[b"job_id"]))

    # -- what completes the follow ---------------------------------------------------------

    def _batch_ids(self) -> list[str]:
        if self.batch_id is not None:
            return [self.batch_id]
        return sorted(_decode(b) for b in self.conn.smembers(keys.run_batches(self.run)))

    def expected_jobs(self) -> set[str]:
        """Every job id of the followed batch (or of every batch submitted to the run)."""
        batch_ids = self._batch_ids()
        with self.conn.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hget(keys.batch(batch_id), "job_ids")
            raw = pipe.execute()
        jobs: set[str] = set()
        for batch_id, value in zip(batch_ids, raw, strict=True):
            if value is None:
                if self.batch_id is not None:
                    raise PipelineError(
                        f"batch {batch_id!r} is unknown to this Redis; check the batch id "
                        "(`Batch.plan.batch_id`) and the Redis URL"
                    )
                continue
            jobs.update(j for j in _decode(value).split(",") if j)
        return jobs

    def _ended_jobs(self, pending: set[str]) -> dict[str, str]:
        ordered = sorted(pending)
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in ordered:
                read_status(pipe, job_id)
            raw = pipe.execute()
        return {j: _decode(s) for j, s in zip(ordered, raw, strict=True) if s and _decode(s) in ENDED_STATES}

    def _complete(self) -> bool:
        """True when every expected job committed, failed or was canceled (never with no batch submitted)."""
        expected = self.expected_jobs()
        if not expected:
            return False
        pending = expected - self._seen
        if not pending:
            return True
        ended = self._ended_jobs(pending)
        if len(ended) == len(pending):
            self.canceled = {j for j, s in ended.items() if s == "canceled"}
            self.failed = {j: f"job {s}" for j, s in ended.items() if s != "canceled"}
            return True
        return False

    # -- iteration -------------------------------------------------------------------------

    def _wanted(self, commit: Commit) -> bool:
        if self.batch_id is None:
            return True
        return commit.batch_id == self.batch_id or commit.job_id.startswith(f"{self.batch_id}-")

    def _await_rewards(self, job_id: str, deadline: float | None) -> None:
        """Block until the job's rewards (or their failure) are recorded."""
        while not self.conn.hexists(keys.reward_jobs(self.run), job_id):
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"following run {self.run}: the rewards of job {job_id} not recorded after {self.timeout}s; "
                    "are reward workers running? (`pipeline reward-worker`)"
                )
            self.conn.xread({keys.reward_log(self.run): "$"}, block=min(self.block_ms, 200))

    def _check_run(self) -> None:
        """Fail fast on a run that has no job at all (a typo, another Redis): it would never end."""
        if self.batch_id is not None or self.conn.exists(keys.run_batches(self.run), self._stream):
            return
        known = registry.runs(self.conn)
        raise UnknownRunError(
            f"run {self.run!r} has no jobs in this Redis (nothing was submitted to it, and it has no commit log); "
            f"runs submitted here: {listing(known)}{did_you_mean(self.run, known)}; submit before following, "
            "or check the run name and the Redis URL"
        )

    def groups(self, keep: Callable[[pa.Table], bool] | None = None) -> Iterator[pa.Table]:
        """Complete groups (all samples of a request, rewards joined with `rewards=True`) as their
        shards commit, those `keep` accepts (e.g. `pipeline.runs.take.rewards_differ`); the cursor moves
        shard by shard."""
        for shard in self:
            for _, group in split_groups(shard.read(rewards=self.rewards)):
                if keep is None or keep(group):
                    yield group

    def __iter__(self) -> Iterator[Shard]:
        self._check_run()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        drained = False  # whether the last XREAD found nothing more to read
        finishing = False
        while True:
            if drained:
                if finishing:
                    break
                if self._complete():
                    if not self.failed:
                        break
                    # One more read for a commit racing its job's failure, then stop.
                    finishing, drained = True, False
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"following run {self.run}: not complete after {self.timeout}s "
                    f"({len(self._seen)} job(s) delivered); {stalled_hint(self.conn, self.run)}"
                )
            block = self.block_ms
            if deadline is not None:
                block = max(1, min(block, int((deadline - time.monotonic()) * 1000)))
            # Drain what is there without blocking; block only once caught up.
            reply = self.conn.xread(
                {self._stream: self.cursor}, count=_READ_COUNT, block=block if drained else None
            )
            entries = reply[0][1] if reply else []
            drained = len(entries) < _READ_COUNT
            for entry_id, fields in entries:
                commit = Shard.from_fields(_decode(entry_id), fields)
                self.cursor = commit.entry_id
                if commit.job_id in self._seen or not self._wanted(commit):
                    continue
                self._seen.add(commit.job_id)
                if self.rewards:
                    self._await_rewards(commit.job_id, deadline)
                yield commit
        self.failed = {j: r for j, r in self.failed.items() if j not in self._seen}
        if self.failed and self.raise_on_failure:
            raise JobsFailedError(self.failed)


def split_groups(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(request id, the request's rows) for each request of a shard's rows, in order of first appearance."""
    ids = table.column("request_id")
    return [(request_id, table.filter(pc.equal(ids, request_id)))
            for request_id in dict.fromkeys(ids.to_pylist())]
