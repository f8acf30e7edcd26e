"""A submitted run of agent episodes from the trainer's side: its counts, waiting for it, reading it.

    run = client.submit_episodes("tasks.jsonl", agent="my_agents:solve", n=8, run="step-3")
    for group in run.groups(follow=True, timeout=3600):   # a task's 8 episodes once all 8 ended
        ...

Over-sampling, as `Batch.take` does for requests: submit more tasks than a step needs, then
`run.take(N, keep=pipeline.rewards_differ)` returns the first N whole groups the filter keeps, as they
end, and cancels the run's episodes still queued or running (`pipeline.core.jobs.episodes.cancel_run`):
the groups not ended are taken off whole (no reader returns a task with a canceled episode,
`pipeline.core.jobs.episodes.trained`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import redis

from pipeline.core.errors import PipelineError, WaitTimeoutError
from pipeline.core.jobs import episodes
from pipeline.read.episodes import episode_groups, episode_trajectories
from pipeline.submit.episodes import EpisodePlan

POLL_S = 0.2


@dataclass
class EpisodeTake:
    """What `EpisodeRun.take` kept (`groups`, one table each, in the order they ended), the task ids the
    filter dropped, and how many episodes it canceled."""

    groups: list[pa.Table]
    dropped: list[str] = field(default_factory=list)
    canceled: int = 0

    @property
    def table(self) -> pa.Table:
        """The kept groups' rows in one table."""
        return pa.concat_tables(self.groups) if self.groups else pa.table({})


@dataclass
class EpisodeRun:
    """The handle `Client.submit_episodes` returns."""

    conn: redis.Redis
    plan: EpisodePlan

    @property
    def run(self) -> str:
        return self.plan.run

    def __repr__(self) -> str:
        """Run, pool, agent and the episodes' counts (the non-zero ones), not the connection."""
        try:
            counts: Any = {status: count for status, count in self.counts().items() if count}
        except redis.RedisError as exc:
            counts = f"unavailable ({type(exc).__name__})"
        return (f"EpisodeRun(run={self.run!r}, pool={self.plan.pool!r}, agent={self.plan.agent!r}, "
                f"episodes={self.plan.episodes}, counts={counts})")

    def counts(self) -> dict[str, int]:
        """submitted, queued, running, finished, failed, canceled, retried, abandoned (a worker died),
        handed_back (a worker shut down), duplicates."""
        info = episodes.run_info(self.conn, self.run)
        return dict(info["counts"]) if info else {}

    def wait(self, timeout: float | None = None) -> dict[str, int]:
        """Block until every episode of the run has an outcome; its counts."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            counts = self.counts()
            if sum(counts[status] for status in episodes.ENDED) >= counts["submitted"]:
                return counts
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeoutError(f"run {self.run!r}: {counts['queued']} episodes queued and {counts['running']} "
                                       f"running after {timeout:g} s (are agent workers running? `pipeline status`)")
            time.sleep(POLL_S)

    def trajectories(self) -> pa.Table:
        """Every committed episode with its trajectory (`pipeline.read.episodes.episode_trajectories`)."""
        return episode_trajectories(self.run, conn=self.conn)

    def groups(self, *, follow: bool = False, timeout: float | None = None,
               keep: Callable[[pa.Table], bool] | None = None) -> Iterator[pa.Table]:
        """Each task's n episodes once all ended (`pipeline.read.episodes.episode_groups`)."""
        return episode_groups(self.run, conn=self.conn, follow=follow, timeout=timeout, keep=keep)

    def outcomes(self) -> dict[str, Any]:
        return episodes.outcomes(self.conn, self.run)

    def cancel(self) -> int:
        """Cancel the run's episodes that have not ended; how many (`pipeline.core.jobs.episodes.cancel_run`)."""
        return episodes.cancel_run(self.conn, self.run)

    def take(self, groups: int, keep: Callable[[pa.Table], bool] | None = None, *, timeout: float | None = None,
             cancel_rest: bool = True) -> EpisodeTake:
        """The first `groups` task groups that end whole and `keep` accepts; then, with `cancel_rest`, cancel
        the episodes still queued or running: their tasks' groups never reach training, finished members
        included."""
        if groups < 1:
            raise PipelineError(f"take {groups} groups: at least 1")
        result = EpisodeTake([])

        def kept(group: pa.Table) -> bool:
            if keep is None or keep(group):
                return True
            result.dropped.append(group.column("task_id")[0].as_py())
            return False

        for group in episode_groups(self.run, conn=self.conn, follow=True, timeout=timeout, keep=kept):
            result.groups.append(group)
            if len(result.groups) == groups:
                break
        if cancel_rest:
            result.canceled = self.cancel()
        return result
