"""The per-run rewards commit stream: one entry per job whose rewards shard was written (or whose
reward function failed), appended once per job.

Reward workers take each rollout commit from the run's commit log through a consumer group
(`pipeline.core.broker.keys.REWARD_GROUP`) and append here when the job's rewards shard is stored. The append
is idempotent per job id (a worker that died after appending and before acknowledging leaves the
entry to another worker, whose append is then a no-op), and keeps the run's reward totals in the
same atomic step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import redis

from pipeline.core.broker import keys

# KEYS: the stream, the run's per-job hash, the run's totals. ARGV: job id, url, rows, reward sum, error,
# groups, groups whose rewards are all equal.
# Returns the entry id, or false when the job's rewards were committed already.
_APPEND = """
local state = 'ok'
if ARGV[5] ~= '' then state = 'failed' end
if redis.call('HSETNX', KEYS[2], ARGV[1], state) == 0 then
  return false
end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'url', ARGV[2], 'rows', ARGV[3],
                         'error', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'jobs', 1)
if state == 'failed' then
  redis.call('HINCRBY', KEYS[3], 'failed', 1)
else
  redis.call('HINCRBY', KEYS[3], 'rows', ARGV[3])
  redis.call('HINCRBYFLOAT', KEYS[3], 'sum', ARGV[4])
  redis.call('HINCRBY', KEYS[3], 'groups', ARGV[6])
  redis.call('HINCRBY', KEYS[3], 'equal_groups', ARGV[7])
end
return entry
"""


@dataclass(frozen=True)
class RewardCommit:
    """A job's rewards: the rewards shard's URL and row count, or the error its function raised."""

    job_id: str
    url: str
    rows: int
    error: str = ""
    entry_id: str = ""

    @classmethod
    def from_fields(cls, entry_id: str, fields: dict[bytes, bytes]) -> Self:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(job_id=f["job_id"], url=f["url"], rows=int(f["rows"]), error=f.get("error", ""),
                   entry_id=entry_id)


def ensure_group(conn: redis.Redis, run: str) -> None:
    """The reward workers' consumer group on the run's commit log, from its start (kept if it exists)."""
    try:
        conn.xgroup_create(keys.commit_log(run), keys.REWARD_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def append(conn: redis.Redis, run: str, commit: RewardCommit, reward_sum: float = 0.0, groups: int = 0,
           equal_groups: int = 0) -> bool:
    """Record a job's rewards (or their failure) once, with their sum and how many of the job's groups
    (a request's samples) got all-equal rewards; False when they were recorded already."""
    entry = conn.register_script(_APPEND)(
        keys=[keys.reward_log(run), keys.reward_jobs(run), keys.reward_totals(run)],
        args=[commit.job_id, commit.url, commit.rows, repr(float(reward_sum)), commit.error, groups, equal_groups],
    )
    return entry is not None


def read_all(conn: redis.Redis, run: str) -> list[RewardCommit]:
    """Every job's rewards commit of the run, in commit order."""
    return [RewardCommit.from_fields(e.decode(), f) for e, f in conn.xrange(keys.reward_log(run))]


@dataclass(frozen=True)
class RewardTotals:
    """A run's rewards so far: jobs done (failed included), failed jobs, rows rewarded, mean reward, and
    the share of groups (a request's samples) whose rewards are all equal (zero variance: DAPO drops them)."""

    jobs: int
    failed: int
    rows: int
    mean: float | None
    zero_variance: float | None


def totals(conn: redis.Redis, run: str) -> RewardTotals:
    raw = {k.decode(): v.decode() for k, v in conn.hgetall(keys.reward_totals(run)).items()}
    rows, groups = int(raw.get("rows", 0)), int(raw.get("groups", 0))
    return RewardTotals(int(raw.get("jobs", 0)), int(raw.get("failed", 0)), rows,
                        float(raw.get("sum", 0.0)) / rows if rows else None,
                        int(raw.get("equal_groups", 0)) / groups if groups else None)
