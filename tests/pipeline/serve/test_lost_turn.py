"""A turn whose push a Redis failover lost (replication is asynchronous; a restart from the
append-only file loses the last second) fails at once, as a failed turn (code `turn_failed`, which
releases its session's turn, so the client's retry runs it again), instead of waiting out the turn
timeout; a turn whose job still waits in its worker's turn queue waits on. The push writes the
entry before the turn's job key (`tests/pipeline/core/jobs/test_turn_queue.py`), so the key never
survives its entry."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pipeline.core.broker import keys, registry
from pipeline.core.jobs import turn_queue
from pipeline.serve.api_error import APIError
from pipeline.serve.dispatch import TurnDispatch
from schemas.worker_info import WorkerInfo
from tests.helpers.turn_jobs import push, turn_job

POOL = keys.pool(None)


def _wait(conn: redis.Redis, turn_id: str, timeout_s: float) -> APIError:
    lane = TurnDispatch(conn, POOL.name, turn_timeout_s=timeout_s)
    try:
        with pytest.raises(APIError) as raised:
            asyncio.run(lane.wait_async(turn_id, "r", time.monotonic(), settled=lambda: None))
        return raised.value
    finally:
        lane.close()


def _live(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="sim", model="m",
                                      started_at=now, heartbeat_at=now))


def test_a_turn_whose_push_was_lost_fails_at_once(redis_client: redis.Redis) -> None:
    _live(redis_client, "w")
    push(redis_client, "w", turn_job("lane-1", "t1"))
    redis_client.delete(POOL.turn_queue("w"), keys.turn_job("t1"))  # the failover kept neither
    started = time.monotonic()
    error = _wait(redis_client, "t1", timeout_s=60)
    assert (error.status, error.code) == (500, "turn_failed")
    assert "its job is gone from Redis" in error.message and "call again" in error.message
    assert time.monotonic() - started < 30  # long before the turn's timeout


def test_a_turn_still_in_its_workers_turn_queue_waits_for_it(redis_client: redis.Redis) -> None:
    _live(redis_client, "w")
    push(redis_client, "w", turn_job("lane-1", "t1"))
    error = _wait(redis_client, "t1", timeout_s=2.5)  # nobody takes it: it waits out its timeout
    assert (error.status, error.code) == (504, "turn_timeout")
    assert turn_queue.queued(redis_client, POOL, "w") == 1
