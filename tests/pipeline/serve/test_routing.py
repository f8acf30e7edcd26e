"""The router's cached reads on the server's loop (`Router.fresh`): a server's first turn waits for
them, a turn finding them a little stale goes on with them while they are read again in a thread,
and one finding them long stale waits (a real redis-server)."""

from __future__ import annotations

import asyncio
import time

import redis

from pipeline.core.broker import keys, registry
from pipeline.serve import routing
from pipeline.serve.routing import Router
from schemas.worker_info import WorkerInfo

POOL = keys.pool(None)


def _live(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="sim", model="m",
                                      started_at=now, heartbeat_at=now))


def _age(router: Router, seconds: float) -> None:
    """Make every cached read `seconds` old."""
    for name in ("_workers", "_desired", "_adapters", "_loads"):
        read_at, value = getattr(router, name)
        setattr(router, name, (read_at - seconds, value))


def test_a_turn_waits_for_the_first_reads_and_for_long_stale_ones_only(redis_client: redis.Redis) -> None:
    router = Router(redis_client, POOL)
    _live(redis_client, "w1")

    async def scenario() -> None:
        await router.fresh()  # nothing read yet: waited for
        assert [w.worker_id for w in router.live_workers()] == ["w1"] and router._refreshing is None
        _live(redis_client, "w2")

        _age(router, 2.0)  # stale, but young enough to serve while read again
        await router.fresh()
        assert router._refreshing is not None  # read in the background, not waited for
        assert [w.worker_id for w in router.live_workers()] == ["w1"]  # the stale read serves meanwhile
        await asyncio.shield(router._refreshing)
        assert sorted(w.worker_id for w in router.live_workers()) == ["w1", "w2"]

        _age(router, routing.STALE_SERVES_S + 1)  # too old to serve: waited for
        _live(redis_client, "w3")
        await router.fresh()
        assert router._refreshing is None
        assert sorted(w.worker_id for w in router.live_workers()) == ["w1", "w2", "w3"]

    asyncio.run(scenario())


def test_without_a_refresh_under_way_a_stale_read_is_read_again_where_it_is_asked(redis_client: redis.Redis) -> None:
    router = Router(redis_client, POOL)
    _live(redis_client, "w1")
    assert [w.worker_id for w in router.live_workers()] == ["w1"]
    _live(redis_client, "w2")
    _age(router, 2.0)
    assert sorted(w.worker_id for w in router.live_workers()) == ["w1", "w2"]
