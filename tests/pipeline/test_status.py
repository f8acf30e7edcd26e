"""`pipeline status`: per-run staleness against the pool's latest pushed weights."""

from __future__ import annotations

import redis

import pipeline
from pipeline import commit_log, keys
from pipeline.status import collect, format_status


def test_runs_show_how_far_their_oldest_tokens_are_behind_the_pushed_version(redis_client: redis.Redis) -> None:
    redis_client.sadd(keys.pool(None).runs, "r")
    for job, version in (("j1", 1), ("j2", 3)):
        commit_log.append(redis_client, "r", commit_log.Commit(job_id=job, batch_id="b", url=f"file:///x/{job}",
                                                                rows=4, tokens=40, weight_version=version))
    pipeline.Client(redis_client).push_weights("/ckpt/4", version=4, timeout=1)
    status = collect(redis_client)
    run = status["pools"]["default"]["runs"]["r"]
    assert run["weight_versions"] == [1, 3] and run["staleness"] == 3
    assert "staleness 3 (oldest token v1 vs pushed v4)" in format_status(status)
