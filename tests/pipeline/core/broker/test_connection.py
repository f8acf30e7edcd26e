"""`connect_redis`'s retries: a client rides out a Redis that is away, until its process is stopping
(`stop_reconnecting`), then fails at once, on every connection of its pool."""

from __future__ import annotations

import time

import pytest
import redis

from pipeline.core.broker.connection import connect_redis, stop_reconnecting
from pipeline.core.broker.redis_server import RedisServer
from tests.helpers.processes import free_port


def test_a_stopped_client_gives_up_on_an_unreachable_redis_at_once(tmp_path) -> None:
    with RedisServer(tmp_path / "redis", port=free_port()) as server:
        conn = connect_redis(server.url, reconnect_for_s=3600)  # would retry for an hour
        conn.set("k", "v")  # a connection made before the stop: it holds its own copy of the retry
    started = time.monotonic()
    stop_reconnecting(conn)
    with pytest.raises(redis.ConnectionError):
        conn.get("k")
    assert time.monotonic() - started < 60  # not the hour it would retry for; a refused connect is instant


def test_stop_reconnecting_within_a_delay_leaves_that_long_to_reconnect(tmp_path) -> None:
    port = free_port()
    with RedisServer(tmp_path / "redis", port=port) as server:
        conn = connect_redis(server.url, reconnect_for_s=3600)
        conn.set("k", "v")
    stop_reconnecting(conn, within_s=3600)  # still an hour: Redis coming back in that time is waited for
    with RedisServer(tmp_path / "redis", port=port):
        assert conn.get("k") == b"v"
