"""`pipeline status`: per-run staleness against the pool's latest pushed weights; jobs waiting to retry."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import redis

import pipeline
from pipeline.audit.status import collect, format_status
from pipeline.broker import commit_log, keys, registry
from pipeline.cli.main import main
from pipeline.errors import UnknownRunError
from pipeline.intake.submit import JOB_FUNCTION, rollout_queue
from schemas.worker_info import WorkerInfo


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


def test_status_of_an_unknown_run_is_an_error_naming_the_runs(
    redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    redis_client.sadd(keys.pool(None).runs, "tiny-step1")
    with pytest.raises(UnknownRunError, match="runs submitted here: tiny-step1; did you mean 'tiny-step1'"):
        collect(redis_client, run="tiny-stpe1")
    assert list(collect(redis_client, run="tiny-step1")["pools"]["default"]["runs"]) == ["tiny-step1"]
    url = redis_client.connection_pool.connection_kwargs
    monkeypatch.setenv("PIPELINE_REDIS_URL", f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}")
    assert main(["status", "--run", "tiny-stpe1"]) == 1
    assert "error: no run 'tiny-stpe1' was submitted to any pool" in capsys.readouterr().err


def test_a_heartbeat_from_a_clock_ahead_is_never_negative(redis_client: redis.Redis) -> None:
    ahead = time.time() + 5  # a worker host whose clock runs ahead
    registry.publish(redis_client, WorkerInfo(worker_id="w", host="h", pid=1, engine="fake", model="m",
                                              started_at=ahead, heartbeat_at=ahead), ttl_s=30)
    status = collect(redis_client)
    assert status["pools"]["default"]["workers"][0]["heartbeat_age_s"] == 0.0
    assert "heartbeat=0.0s ago" in format_status(status) and "-" not in format_status(status).split("heartbeat=")[1][:2]


def test_jobs_waiting_out_their_retry_backoff_are_shown(redis_client: redis.Redis) -> None:
    queue = rollout_queue(redis_client)
    queue.enqueue_in(timedelta(minutes=5), JOB_FUNCTION, {"n": 1})  # where RQ puts a retry with an interval
    status = collect(redis_client)
    assert status["pools"]["default"]["queue"]["retrying"] == 1
    assert "0 queued, 1 waiting to retry, 0 running, 0 failed" in format_status(status)
