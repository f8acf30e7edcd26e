"""`FailoverConnection`: a Lua script whose write a demoted master refuses (`-READONLY` wrapped in a
script error) is a failover like any other: the retry (`retry_policy`) drops the connection and
reconnects to the master the sentinels name now, and runs the script there. Two real redis-servers: one made a
replica (what a demoted master is), the other the promoted one; the "sentinels" are a pool that
names one, then the other."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pipeline.core.broker.connection import FailoverConnection, retry_policy
from pipeline.core.broker.redis_server import RedisServer
from tests.helpers.processes import free_port

WRITE = "return redis.call('SET', KEYS[1], ARGV[1])"


class Sentinels(redis.ConnectionPool):
    """The sentinels' answers, in order: each (re)connect asks again; the last answer stays."""

    def __init__(self, masters: list[tuple[str, int]]) -> None:
        super().__init__(connection_class=FailoverConnection, retry=retry_policy(30))
        self.masters = masters
        self.asked = 0
        self.is_master = True
        self.check_connection = False
        self.connection_kwargs["connection_pool"] = self

    def get_master_address(self) -> tuple[str, int]:
        self.asked += 1
        return self.masters.pop(0) if len(self.masters) > 1 else self.masters[0]


@pytest.fixture
def demoted(tmp_path: Path) -> redis.Redis:
    with RedisServer(tmp_path / "demoted", port=free_port()) as server:
        client = redis.Redis.from_url(server.url)
        client.replicaof("127.0.0.1", free_port())  # a replica of a master that is gone: read-only
        yield client


def test_a_script_refused_by_a_demoted_master_runs_again_on_the_promoted_one(
    demoted: redis.Redis, redis_client: redis.Redis
) -> None:
    with pytest.raises(redis.ResponseError, match="READONLY"):  # what a plain connection reports
        demoted.eval(WRITE, 1, "k", "v")
    old = demoted.connection_pool.connection_kwargs
    new = redis_client.connection_pool.connection_kwargs
    sentinels = Sentinels([(old["host"], old["port"]), (new["host"], new["port"])])
    client = redis.Redis(connection_pool=sentinels)
    assert client.eval(WRITE, 1, "k", "moved") == b"OK"
    assert sentinels.asked == 2  # the refusal dropped the connection; the retry asked the sentinels again
    assert redis_client.get("k") == b"moved" and demoted.get("k") is None
