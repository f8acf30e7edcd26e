"""Staleness by admission: an episode starts only while its training step is within the run's budget.

A run submitted with `--max-staleness K --groups-per-step B` is trained B tasks (groups) a step, in
task order, and the trainer pushes one weight version a step. The tasks of step s (the s-th B of
them, counting from the submit) may start once the pool's desired weight version has reached the
version at submit + s - K: no episode starts on weights more than K versions older than the ones it
will be trained against, and none is ever discarded for it; it waits. This is AReaL's rule
(rollouts started ≤ (version + K + 1) × batch), counted in groups. Episodes of a run submitted
without it start at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import redis

from pipeline.core.broker import control_channel, keys
from pipeline.core.errors import PipelineError
from schemas.episode import EpisodeJob

POLL_S = 0.5


def needed_version(spec: dict[str, Any], group_index: int) -> int | None:
    """The desired weight version the task at `group_index` waits for (None: no budget)."""
    if spec.get("max_staleness") is None or not spec.get("groups_per_step"):
        return None
    step = group_index // int(spec["groups_per_step"])
    return int(spec.get("base_version") or 0) + step - int(spec["max_staleness"])


class Admission:
    """Waits episodes of one pool for their budget (run specs read once per run)."""

    def __init__(self, conn: redis.Redis, pool: str) -> None:
        self.conn = conn
        self.pool = pool
        self._specs: dict[str, dict[str, Any]] = {}

    def _spec(self, run: str) -> dict[str, Any]:
        if run not in self._specs:
            raw = self.conn.hget(keys.episode_run(run), "spec")
            self._specs[run] = json.loads(raw) if raw else {}
        return self._specs[run]

    def _version(self) -> int:
        try:
            return control_channel.read_state(self.conn, self.pool).weight_version or 0
        except PipelineError:
            return 0

    async def wait(self, job: EpisodeJob, stopping: asyncio.Event) -> bool:
        """Return once the episode may start (True), or when the worker is stopping first (False)."""
        needed = needed_version(await asyncio.to_thread(self._spec, job.run), job.group_index)
        if needed is None:
            return True
        while await asyncio.to_thread(self._version) < needed:
            if stopping.is_set():
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), POLL_S)
        return True
