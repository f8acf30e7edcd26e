"""The rewards section of `pipeline report`: mean reward per step and per weight version.

Rewards come from the rewards shards reward workers write beside the rollout shards (a batch
submitted with `--reward NAME`; `pipeline.core.rewards`). Read by run (with a Redis connection),
only the jobs whose rewards the run's reward log records as written count, as `read_rollouts(...,
rewards=True)` reads them; read by URL, every rewards shard found beside a rollout shard.

- **Step**: a trainer's step is a submitted batch. A row's batch is its job id's batch id (job
  ids are `<batch id>-NNNNN`); batches are ordered by their rows' `submitted_at` (the batch's
  submit time, the same on every job of it), ties by batch id. Only batches with a rewarded row
  are steps, numbered from 0 (held-out batches submitted without a reward function are not).
- **Version**: a row continued across a partial swap counts under the version of its last token
  (the one that finished it: its last `weight_version_segments` entry), not under its
  `weight_version` column (its oldest token's); rows with one version count under it.

Rows without a reward (submitted without a reward function, not scored yet, or whose function
failed) are left out and counted in the section's note; with no rewarded row there is no section.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import redis

from pipeline.audit.report_html import html_section, html_table, new_figure, png
from pipeline.core.broker import reward_log
from pipeline.core.shards import join_rewards
from schemas.shard import REWARDS_SCHEMA, rewards_path

_JOB_OF_BATCH = re.compile(r"(?P<batch>.+)-\d{5,}")
TITLE = "Rewards per step and weight version"


def batch_of(job_id: str) -> str:
    """The batch a job belongs to: its id less the `-NNNNN` job number (the id itself otherwise)."""
    match = _JOB_OF_BATCH.fullmatch(job_id)
    return match.group("batch") if match else job_id


def final_version(row: dict[str, Any]) -> int:
    """The weight version of the row's last token."""
    segments = row["weight_version_segments"]
    return int(segments[-1]["version"]) if segments else int(row["weight_version"])


def written_rewards(conn: redis.Redis, run: str) -> set[str]:
    """The run's jobs whose rewards shard its reward log records as written (failed ones left out)."""
    return {commit.job_id for commit in reward_log.read_all(conn, run) if not commit.error}


def with_rewards(batch: pa.RecordBatch, filesystem: pafs.FileSystem | None, shard_path: str | None,
                 jobs: set[str] | None) -> pa.Table:
    """`batch` (with `rollout_id`) and its `reward` column from the rewards shard beside `shard_path`
    (null where none: no such shard, or its job not in `jobs` when given)."""
    found = REWARDS_SCHEMA.empty_table()
    if filesystem is not None and shard_path is not None:
        beside = rewards_path(shard_path)
        job = shard_path.rsplit("/", 1)[-1][: -len(".parquet")]
        if (jobs is None or job in jobs) and filesystem.get_file_info(beside).type != pafs.FileType.NotFound:
            found = pads.dataset(beside, schema=REWARDS_SCHEMA, filesystem=filesystem, format="parquet").to_table()
    return join_rewards(pa.Table.from_batches([batch]), found).drop_columns(["reward_info"])


@dataclass
class RewardFigures:
    """Rewarded rows' rewards per final version and per batch, and the rows without a reward."""

    by_version: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    continued: Counter = field(default_factory=Counter)  # final version -> rewarded rows continued across a swap
    by_batch: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    submitted: dict[str, datetime] = field(default_factory=dict)  # batch -> its earliest submitted_at
    batch_versions: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    unrewarded: int = 0

    def add(self, row: dict[str, Any]) -> None:
        if row["reward"] is None:
            self.unrewarded += 1
            return
        reward, version, batch = float(row["reward"]), final_version(row), batch_of(row["job_id"])
        self.by_version[version].append(reward)
        self.continued[version] += bool(row["weight_version_segments"])
        self.by_batch[batch].append(reward)
        self.batch_versions[batch].add(version)
        at = row["submitted_at"]
        self.submitted[batch] = min(at, self.submitted.get(batch, at))

    @property
    def rows(self) -> int:
        return sum(len(values) for values in self.by_version.values())

    def steps(self) -> list[str]:
        """The rewarded batches in submit order."""
        return sorted(self.by_batch, key=lambda batch: (self.submitted[batch], batch))


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Mean, sample standard deviation and standard error of the mean (NaN for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    std = statistics.stdev(values)
    return mean, std, std / math.sqrt(len(values))


def rewards_section(f: RewardFigures) -> str | None:
    """The section (None when no row has a reward)."""
    if not f.rows:
        return None
    steps, versions = f.steps(), sorted(f.by_version)
    step_stats = [_spread(f.by_batch[batch]) for batch in steps]
    version_stats = [_spread(f.by_version[v]) for v in versions]
    fig, (left, right) = new_figure(columns=2)
    from matplotlib.ticker import MaxNLocator  # matplotlib only once a plot is drawn

    left.errorbar(range(len(steps)), [m for m, _, _ in step_stats],
                  yerr=[0.0 if math.isnan(se) else se for _, _, se in step_stats], marker="o", capsize=3)
    left.set_xlabel("step (batch, in submit order)")
    left.set_ylabel("mean reward (± standard error)")
    right.errorbar(versions, [m for m, _, _ in version_stats],
                   yerr=[0.0 if math.isnan(se) else se for _, _, se in version_stats], marker="o", capsize=3)
    right.set_xlabel("weight version (of the row's last token)")
    for axis in (left, right):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole numbers
    step_rows = [[step, batch, _utc(f.submitted[batch]), len(f.by_batch[batch]), mean, std,
                  ", ".join(f"v{v}" for v in sorted(f.batch_versions[batch]))]
                 for step, (batch, (mean, std, _)) in enumerate(zip(steps, step_stats, strict=True))]
    version_rows = [[f"v{v}", len(f.by_version[v]), mean, std, f.continued[v]]
                    for v, (mean, std, _) in zip(versions, version_stats, strict=True)]
    tables = (html_table(["step", "batch", "submitted (UTC)", "rows", "mean reward", "std", "versions"], step_rows)
              + html_table(["version", "rows", "mean reward", "std", "continued rows"], version_rows))
    note = ("step: a submitted batch (the batch id of its rows' job ids), in submit order (submitted_at), counting "
            "only batches with rewarded rows; version: the weight version of the row's last token, so a row "
            "continued across a partial swap counts under the version that finished it (continued rows: how many "
            "did); std: the sample standard deviation of the rows' rewards, the plot's bars one standard error")
    if f.unrewarded:
        note += (f"; {f.unrewarded} row(s) have no reward (submitted without a reward function, not scored yet, "
                 "or whose reward function failed) and are left out")
    return html_section(TITLE, png(fig), tables, note=note)


def _utc(at: datetime) -> str:
    """A UTC time to the second."""
    return at.astimezone(UTC).isoformat(timespec="seconds")
