"""A Redis that refuses commands until its replicas, master or data are back (`NOREPLICAS`,
`READONLY`, `MASTERDOWN`, `LOADING`, `TRYAGAIN`) is waited out like a lost connection: the client's
command retries and goes through once the Redis takes it (real redis-server); a wrong command is
still raised at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
from redis._parsers.base import BaseParser

from pipeline.core.broker.connection import connect_redis, is_unavailable
from pipeline.core.broker.redis_server import RedisServer
from tests.helpers.processes import free_port, wait_until
from tests.helpers.refusing_redis import allow_writes, refusals, refuse_writes

WRITE_IN_SCRIPT = "return redis.call('SET', KEYS[1], ARGV[1])"


@pytest.mark.parametrize("reply", [
    "NOREPLICAS Not enough good replicas to write.",
    "READONLY You can't write against a read only replica.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "LOADING Redis is loading the dataset in memory",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "Error running script (call to f_0): @user_script:1: @user_script: 1: -NOREPLICAS Not enough good replicas "
    "to write.",
])
def test_a_refusal_until_redis_is_whole_again_is_unavailable(reply: str) -> None:
    assert is_unavailable(BaseParser.parse_error(reply))


@pytest.mark.parametrize("reply", [
    "ERR unknown command 'NOSUCH'",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOSCRIPT No matching script.",
    "WRONGPASS invalid username-password pair or user is disabled.",
    "Error running script (call to f_0): @user_script:1: Script attempted to access a non local key",
])
def test_a_wrong_command_is_not(reply: str) -> None:
    assert not is_unavailable(BaseParser.parse_error(reply))


def test_a_lost_connection_is_unavailable_a_refused_password_or_another_timeout_is_not() -> None:
    assert is_unavailable(redis.ConnectionError("Connection refused")) and is_unavailable(redis.TimeoutError())
    assert not is_unavailable(redis.AuthenticationError("invalid password"))
    assert not is_unavailable(TimeoutError("a wait ran out"))  # Python's own (an asyncio wait's): not Redis


@pytest.mark.parametrize("how", ["command", "script", "transaction"])
def test_a_write_refused_for_want_of_replicas_goes_through_once_they_are_back(
        redis_client: redis.Redis, redis_url: str, how: str) -> None:
    client = connect_redis(redis_url, reconnect_for_s=60)
    before = refusals(redis_client)
    refuse_writes(redis_client)
    # Writes come back once the client has been refused a few times (it did not raise at the first).
    restorer = threading.Thread(target=lambda: (
        wait_until(lambda: refusals(redis_client) >= before + 3, 60, "three refusals"), allow_writes(redis_client)))
    restorer.start()
    try:
        if how == "command":
            assert client.incr("n") == 1
        elif how == "script":
            assert client.register_script(WRITE_IN_SCRIPT)(keys=["k"], args=["v"]) == b"OK"
            assert client.incr("n") == 1
        else:
            with client.pipeline() as pipe:
                assert pipe.incr("n").set("k", "v").execute() == [1, True]
    finally:
        restorer.join()
        allow_writes(redis_client)
    assert redis_client.get("n") == b"1"  # run once: a refused command was not run


def test_a_demoted_master_is_waited_out_too(redis_client: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """`READONLY` (a replica): the write goes through once the server is a master again."""
    with RedisServer(tmp_path / "demoted", port=free_port()) as server:
        admin = server.client()
        admin.replicaof("127.0.0.1", free_port())  # a replica of a master that is gone: read-only
        client = connect_redis(server.url, reconnect_for_s=60)
        promoter = threading.Thread(target=lambda: (
            wait_until(lambda: refusals(admin) >= 3, 60, "three refusals"), admin.replicaof("NO", "ONE")))
        promoter.start()
        try:
            assert client.register_script(WRITE_IN_SCRIPT)(keys=["k"], args=["v"]) == b"OK"
        finally:
            promoter.join()
        assert admin.get("k") == b"v"


def test_a_refusal_that_outlasts_the_reconnect_time_is_raised(redis_client: redis.Redis, redis_url: str) -> None:
    redis_client.set("text", "v")
    refuse_writes(redis_client)
    try:
        with pytest.raises(redis.ResponseError, match="NOREPLICAS"):
            connect_redis(redis_url, reconnect_for_s=0.5).set("k", "v")
        # A wrong command is raised at once (retried, it would take the ten minutes).
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            connect_redis(redis_url, reconnect_for_s=600).hget("text", "field")
    finally:
        allow_writes(redis_client)
