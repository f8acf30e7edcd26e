"""A turn whose item a Redis failover lost from its worker's own lane (replication is asynchronous:
the push can be lost while the turn's job key survives) is answered 503 within a second or two, as
a failed turn (code `turn_failed`, which releases its session's turn, so the client's retry runs it
again); a turn whose item still waits in the lane waits on."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pipeline.core.broker import keys, registry
from pipeline.core.errors import APIError
from pipeline.serve.lane import Lane
from schemas.worker_info import WorkerInfo
from tests.helpers.lanes import item, push

POOL = keys.pool(None)


def _wait(conn: redis.Redis, turn_id: str, timeout_s: float) -> APIError:
    lane = Lane(conn, POOL.name, turn_timeout_s=timeout_s)
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


def test_a_turn_lost_from_a_live_workers_lane_is_answered_503_at_once(redis_client: redis.Redis) -> None:
    _live(redis_client, "w")
    push(redis_client, "w", item("lane-1", "t1"))
    redis_client.delete(POOL.turn_lane("w"))  # the failover kept the turn's job key, not the push
    started = time.monotonic()
    error = _wait(redis_client, "t1", timeout_s=60)
    assert (error.status, error.code, error.headers) == (503, "turn_failed", {"Retry-After": "1"})
    assert "no longer in worker w's lane" in error.message
    assert time.monotonic() - started < 30  # long before the turn's timeout


def test_a_turn_still_in_its_workers_lane_waits_for_it(redis_client: redis.Redis) -> None:
    _live(redis_client, "w")
    push(redis_client, "w", item("lane-1", "t1"))
    error = _wait(redis_client, "t1", timeout_s=2.5)  # nobody takes it: it waits out its timeout
    assert (error.status, error.code) == (504, "turn_timeout")
    assert redis_client.llen(POOL.turn_lane("w")) == 1
