"""A submitted run of agent episodes from the trainer's side: its counts, waiting for it, reading it.

    run = client.submit_episodes("tasks.jsonl", agent="my_agents:solve", n=8, run="step-3")
    for group in run.groups(follow=True, timeout=3600):   # a task's 8 episodes once all 8 ended
        ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import redis

from pipeline.core.errors import WaitTimeoutError
from pipeline.core.jobs import episodes
from pipeline.read.episodes import episode_groups, episode_trajectories
from pipeline.submit.episodes import EpisodePlan

POLL_S = 0.2


@dataclass
class EpisodeRun:
    """The handle `Client.submit_episodes` returns."""

    conn: redis.Redis
    plan: EpisodePlan

    @property
    def run(self) -> str:
        return self.plan.run

    def counts(self) -> dict[str, int]:
        """submitted, queued, running, finished, failed, retried, abandoned (a worker died), duplicates."""
        info = episodes.run_info(self.conn, self.run)
        return dict(info["counts"]) if info else {}

    def wait(self, timeout: float | None = None) -> dict[str, int]:
        """Block until every episode of the run has an outcome; its counts."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            counts = self.counts()
            if counts["finished"] + counts["failed"] >= counts["submitted"]:
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
