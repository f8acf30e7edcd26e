"""The per-run commit log: a Redis stream with one entry per shard a worker committed.

Readers dedupe by job id (a retried job rewrites the same shard and appends again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import redis

from pipeline import keys


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


def append(conn: redis.Redis | redis.client.Pipeline, run: str, commit: Commit) -> None:
    conn.xadd(
        keys.commit_log(run),
        {
            "job_id": commit.job_id,
            "batch_id": commit.batch_id,
            "url": commit.url,
            "rows": commit.rows,
            "tokens": commit.tokens,
            "weight_version": commit.weight_version,
        },
    )


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
