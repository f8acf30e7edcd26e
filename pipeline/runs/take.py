"""Taking N complete groups from a batch as they finish, filtered, and canceling the rest.

A group is all n samples of one request (they are always in the same shard: a job carries whole
requests). `take` reads each job of the batch as soon as it is ready (its shard committed, and,
when the run has a reward function, its rewards recorded), hands each group to `keep` (a plain
Python callable on a `pyarrow.Table` of the group's rows, rewards joined), keeps the groups it
accepts until N are kept, then cancels what remains of the batch (`pipeline.runs.cancel`). Built-in
filter: `rewards_differ`, DAPO's dynamic sampling (drop a group whose rewards are all equal: its
group-normalised advantages are all zero, so it teaches nothing).

Over-sampling: `submit(..., groups=N, oversample=F)` enqueues the first ceil(N x F) requests and
records N on the batch, so `batch.take()` gets N kept groups in one round when the filter drops
fewer than 1 - 1/F of them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa
import redis

from pipeline.core.broker import commit_log, keys, reward_log
from pipeline.core.errors import PipelineError, WaitTimeoutError
from pipeline.core.shards import read_rollouts
from pipeline.read.follow import split_groups
from pipeline.runs.cancel import CancelResult
from pipeline.submit.enqueue import SubmitPlan

GroupFilter = Callable[[pa.Table], bool]


class RewardsFailedWarning(UserWarning):
    """`Batch.take` dropped groups because their reward function failed (not because the filter
    rejected them): the rewards, not the rollouts, need looking into."""
_POLL_MS = 200


def rewards_differ(group: pa.Table) -> bool:
    """DAPO's filter: keep a group unless all its rewards are equal (zero variance, zero advantage)."""
    if "reward" not in group.column_names:
        raise PipelineError("rewards_differ filters on rewards: submit the batch with a reward function "
                            "(--reward NAME)")
    rewards = group.column("reward")
    if rewards.null_count:
        return False  # rewards that failed: nothing to learn from either
    return len(set(rewards.to_pylist())) > 1


@dataclass
class TakeResult:
    """What `Batch.take` kept (`table`: the kept groups' rows, groups in the order they were kept;
    `groups`: their request ids), dropped (request ids the filter rejected, or whose rewards
    failed), left over (complete groups read past the N-th) and canceled; `reward_errors`: the
    jobs whose reward function failed, with its error (a `RewardsFailedWarning` says so)."""

    table: pa.Table
    groups: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    surplus: list[str] = field(default_factory=list)
    canceled: CancelResult | None = None
    reward_errors: dict[str, str] = field(default_factory=dict)

    @property
    def drop_rate(self) -> float:
        seen = len(self.groups) + len(self.dropped)
        return len(self.dropped) / seen if seen else 0.0


class Takeable(Protocol):
    """What `take` reads of a batch and does to it (`pipeline.runs.batch.Batch` is one)."""

    conn: redis.Redis
    plan: SubmitPlan

    @property
    def run(self) -> str: ...

    @property
    def job_ids(self) -> list[str]: ...

    @property
    def reward(self) -> str | None: ...

    def job_states(self) -> dict[str, str]: ...

    def cancel(self) -> CancelResult: ...


def _ready_jobs(batch: Takeable, reward: str | None, taken: set[str]) -> list[tuple[str, str, str]]:
    """(job id, shard URL, its reward function's error or "") of the batch's jobs ready to read and
    not taken yet, in commit order."""
    ours = set(batch.job_ids) - taken
    commits = [c for c in commit_log.read_all(batch.conn, batch.run) if c.job_id in ours]
    if reward is None:
        return [(c.job_id, c.url, "") for c in commits]
    scored = {r.job_id: r.error for r in reward_log.read_all(batch.conn, batch.run)}
    return [(c.job_id, c.url, scored[c.job_id]) for c in commits if c.job_id in scored]


def take(batch: Takeable, groups: int | None = None, keep: GroupFilter | None = None, *,
         timeout: float | None = None, cancel_rest: bool = True) -> TakeResult:
    """Up to `groups` (default: the batch's `groups` from submit) complete groups that `keep`
    accepts (all when None), as jobs finish; then cancel what remains (unless `cancel_rest=False`).
    Returns fewer when the batch ends first. `WaitTimeoutError` after `timeout` seconds."""
    wanted = groups if groups is not None else batch.plan.groups
    if wanted is None or wanted < 1:
        raise PipelineError("take how many groups? pass groups=N (or submit with groups=N)")
    reward = batch.reward
    deadline = None if timeout is None else time.monotonic() + timeout
    kept: list[pa.Table] = []
    failed_groups = 0  # groups dropped because their rewards failed
    result = TakeResult(table=pa.table({}))
    taken: set[str] = set()
    while len(result.groups) < wanted:
        ready = _ready_jobs(batch, reward, taken)
        for job_id, url, error in ready:
            taken.add(job_id)
            if error:
                result.reward_errors[job_id] = error
            table = read_rollouts(url, rewards=reward is not None, conn=None)
            for request_id, group in split_groups(table):
                if len(result.groups) >= wanted:
                    result.surplus.append(request_id)
                elif keep is None or keep(group):
                    result.groups.append(request_id)
                    kept.append(group)
                else:
                    result.dropped.append(request_id)
                    failed_groups += bool(error)
        if len(result.groups) >= wanted:
            break
        states = batch.job_states()
        if all(s in {"canceled", "failed", "stopped", "missing"} or (s == "finished" and j in taken)
               for j, s in states.items()):
            break  # every job read or ended without rows: fewer groups than asked
        if deadline is not None and time.monotonic() > deadline:
            raise WaitTimeoutError(f"take from run {batch.run}: {len(result.groups)}/{wanted} groups kept after "
                                   f"{timeout}s; are rollout{' and reward' if reward else ''} workers running?")
        _wait(batch, reward)
    if cancel_rest and len(result.groups) >= wanted:
        left = [j for j, s in batch.job_states().items() if s not in {"finished", "failed", "canceled"}]
        if left:
            result.canceled = batch.cancel()
    result.table = pa.concat_tables(kept) if kept else pa.table({})
    if failed_groups:
        first = next(iter(result.reward_errors.values()))
        warnings.warn(
            f"take from run {batch.run}: the rewards of {len(result.reward_errors)} job(s) failed (reward function "
            f"{reward!r}: {first}), so their {failed_groups} group(s) were dropped and {len(result.groups)} of "
            f"{wanted} kept; fix the reward function (`TakeResult.reward_errors` lists each job's error)",
            RewardsFailedWarning, stacklevel=3)
    return result


def _wait(batch: Takeable, reward: str | None) -> None:
    """Block until something new may be ready (a commit, or a rewards record), at most a poll."""
    stream = keys.reward_log(batch.run) if reward is not None else keys.commit_log(batch.run)
    batch.conn.xread({stream: "$"}, block=_POLL_MS)
