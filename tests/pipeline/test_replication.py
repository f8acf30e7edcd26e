"""Acknowledged means replicated: submit, commit, control changes and acks wait for a real replica."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline import commit_log, control, keys
from pipeline.commit_log import Commit
from pipeline.connection import connect_redis
from pipeline.redis_server import RedisServer
from pipeline.replication import replicated, wanted_replicas
from pipeline.submit import submit_requests
from schemas.control import WeightAck
from schemas.request import RolloutRequest
from tests.helpers import free_port, wait_until
from workers.control import write_ack


@pytest.fixture
def master_and_replica(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    master = RedisServer(tmp_path / "master", port=free_port())
    master.ensure_started()
    replica = RedisServer(tmp_path / "replica", port=free_port(), replica_of=master.port)
    try:
        replica.ensure_started()
        wait_until(lambda: master.client().info("replication")["connected_slaves"] == 1, what="the replica to link")
        wait_until(lambda: replica.client().info("replication")["master_link_status"] == "up", what="the sync")
        for server in (master, replica):  # the AOF rewrite after the first sync done (a shutdown refuses then)
            wait_until(lambda s=server: not _rewriting(s), what="the AOF rewrite")
        yield master, replica
    finally:
        try:
            replica.stop()
        finally:
            master.stop()


def test_no_wait_without_replicas_or_when_turned_off(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.delenv("PIPELINE_REDIS_WAIT_REPLICAS", raising=False)
    assert replicated(connect_redis(redis_url), "a write") is None  # auto: a master without replicas
    assert replicated(fakeredis.FakeRedis(), "a write") is None  # no INFO at all: nothing to wait for
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "0")
    assert wanted_replicas(fakeredis.FakeRedis()) == 0
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "some")
    with pytest.raises(ValueError, match="PIPELINE_REDIS_WAIT_REPLICAS='some': use auto, 0"):
        replicated(fakeredis.FakeRedis(), "a write")
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "0")
    with pytest.raises(ValueError, match="PIPELINE_REDIS_WAIT_TIMEOUT_MS='0'"):
        replicated(fakeredis.FakeRedis(), "a write")


def test_acknowledged_writes_are_on_the_replica_when_they_return(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, master_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = master_and_replica
    monkeypatch.delenv("PIPELINE_REDIS_WAIT_REPLICAS", raising=False)  # auto: one replica, as it has one
    conn, copy = connect_redis(master.url), replica.client()
    assert wanted_replicas(conn) == 1
    plan = submit_requests(conn, [RolloutRequest(id="r0", input_ids=[1, 2])], run="rep",
                           output=f"file://{tmp_path}/shards")
    assert copy.hget(keys.batch(plan.batch_id), "job_ids").decode() == ",".join(plan.job_ids)
    assert commit_log.append(conn, "rep", Commit(plan.job_ids[0], plan.batch_id, "file:///x.parquet", 1, 3, 0))
    assert copy.xlen(keys.commit_log("rep")) == 1
    state = control.pause(conn)
    assert copy.get(keys.pool(None).control_state).decode() == control.encode_state(state, keys.pool(None).name)
    write_ack(conn, WeightAck(worker="w0", version=3, ok=True, seconds=0.0))
    assert copy.hexists(keys.pool(None).weight_acks(3), "w0")


def test_a_replica_that_does_not_confirm_in_time_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    master_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = master_and_replica
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "200")
    conn = connect_redis(master.url)
    stalled = threading.Event()

    def stall() -> None:  # the replica busy for longer than the timeout: it cannot acknowledge
        stalled.set()
        replica.client().execute_command("DEBUG", "SLEEP", "1.5")

    sleeper = threading.Thread(target=stall)
    sleeper.start()
    stalled.wait()
    wait_until(lambda: _busy(replica), what="the replica to stall")
    with caplog.at_level(logging.WARNING, logger="pipeline.replication"):
        assert replicated(conn, "the test's write") == 0
    sleeper.join()
    assert "the test's write: written on the Redis master but 0 of 1 replica(s) confirmed it within 200 ms" \
        in caplog.text
    assert replicated(conn, "the next write") == 1  # the replica is back


def _busy(server: RedisServer) -> bool:
    try:
        redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.05, retry=Retry(NoBackoff(), 0)).ping()
    except redis.TimeoutError:
        return True
    return False


def _rewriting(server: RedisServer) -> bool:
    info = server.client().info("persistence")
    return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"] or info["rdb_bgsave_in_progress"])
