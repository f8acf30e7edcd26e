"""The per-run commit log: a Redis stream with one entry per shard a worker committed.

Readers dedupe by job id (a retried job rewrites the same shard and appends again). Each
append also keeps the run's totals (shards, rows, tokens, shards per weight version) in the
same atomic step, a job committed again replacing its earlier numbers, so `pipeline status`
reads a few fields instead of every commit of every run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import redis

from pipeline.core.broker import keys
from pipeline.core.broker.replication import Proof, replicated, write_until_kept


@dataclass(frozen=True)
class Commit:
    job_id: str
    batch_id: str
    url: str
    rows: int
    tokens: int
    weight_version: int
    entry_id: str = ""

    @classmethod
    def from_fields(cls, entry_id: str, fields: dict[bytes, bytes]) -> Self:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        return cls(
            job_id=f["job_id"],
            batch_id=f.get("batch_id", ""),
            url=f["url"],
            rows=int(f["rows"]),
            tokens=int(f["tokens"]),
            weight_version=int(f["weight_version"]),
            entry_id=entry_id,
        )


# KEYS: the stream, the run's per-job hash, the run's totals, the run's canceled jobs. ARGV: the
# commit's fields. A canceled job is refused (nothing changes; returns false).
# (`0 - x`, not `-x`: Lua's -0 reaches Redis as "-0", which HINCRBY refuses.)
_APPEND = """
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 1 then
  return false
end
local entry = redis.call('XADD', KEYS[1], '*', 'job_id', ARGV[1], 'batch_id', ARGV[2], 'url', ARGV[3],
                         'rows', ARGV[4], 'tokens', ARGV[5], 'weight_version', ARGV[6])
local previous = redis.call('HGET', KEYS[2], ARGV[1])
if previous then
  local rows, tokens, version = string.match(previous, '^(%d+) (%d+) (%d+)$')
  redis.call('HINCRBY', KEYS[3], 'rows', 0 - tonumber(rows))
  redis.call('HINCRBY', KEYS[3], 'tokens', 0 - tonumber(tokens))
  redis.call('HINCRBY', KEYS[3], 'shards_v' .. version, -1)
else
  redis.call('HINCRBY', KEYS[3], 'shards', 1)
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4] .. ' ' .. ARGV[5] .. ' ' .. ARGV[6])
redis.call('HINCRBY', KEYS[3], 'rows', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'shards_v' .. ARGV[6], 1)
return entry
"""


def append(conn: redis.Redis, run: str, commit: Commit) -> bool:
    """Append the commit to the run's stream and update the run's totals, atomically; False (and
    nothing appended) when the job was canceled (`pipeline.runs.cancel`). Returns once a replica has it
    (`pipeline.core.broker.replication`); an append lost in a failover is made again on the new master."""
    stream = keys.commit_log(run)

    def write() -> bytes | None:
        return conn.register_script(_APPEND)(
            keys=[stream, keys.run_jobs(run), keys.run_totals(run), keys.canceled(run)],
            args=[commit.job_id, commit.batch_id, commit.url, commit.rows, commit.tokens, commit.weight_version],
        )

    def confirm(entry: bytes | None) -> None:
        if entry is not None:  # refused (canceled): nothing was written
            replicated(conn, what, Proof(("XRANGE", stream, entry, entry)))

    what = f"commit of job {commit.job_id} in run {run!r}"
    return write_until_kept(write, confirm, what) is not None


@dataclass(frozen=True)
class RunTotals:
    """What a run has committed: one shard per job (the latest commit of a job counts)."""

    shards: int
    rows: int
    tokens: int
    weight_versions: list[int]


def totals(conn: redis.Redis, run: str) -> RunTotals:
    """The run's totals; computed from the stream for runs committed before totals were kept."""
    fields = {k.decode(): int(v) for k, v in conn.hgetall(keys.run_totals(run)).items()}
    if not fields:
        commits = read_all(conn, run)
        return RunTotals(len(commits), sum(c.rows for c in commits), sum(c.tokens for c in commits),
                         sorted({c.weight_version for c in commits}))
    versions = sorted(int(name[len("shards_v"):]) for name, count in fields.items()
                      if name.startswith("shards_v") and count > 0)
    return RunTotals(fields.get("shards", 0), fields.get("rows", 0), fields.get("tokens", 0), versions)


def read_after(conn: redis.Redis, run: str, entry_id: str | None) -> list[Commit]:
    """The run's commits appended after stream entry `entry_id` (all of them for None), in order."""
    start = "-" if entry_id is None else f"({entry_id}"
    return [Commit.from_fields(e.decode(), fields) for e, fields in conn.xrange(keys.commit_log(run), min=start)]


def read_all(conn: redis.Redis, run: str) -> list[Commit]:
    """Every commit of a run, one per job id (the latest), in commit order."""
    latest: dict[str, Commit] = {}
    for commit in read_after(conn, run, None):
        latest.pop(commit.job_id, None)
        latest[commit.job_id] = commit
    return list(latest.values())
