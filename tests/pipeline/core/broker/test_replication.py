"""Acknowledged means replicated: submit, commit, control changes and acks wait for a real replica."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline.core.broker import commit_log, control_channel, keys
from pipeline.core.broker.commit_log import Commit
from pipeline.core.broker.connection import connect_redis
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.broker.replication import Proof, replicated, wanted_replicas
from pipeline.core.errors import WriteLostError
from pipeline.core.jobs.queue import rollout_queue
from pipeline.submit.enqueue import SubmitPlan, submit_requests
from schemas.control import WeightAck
from schemas.request import RolloutRequest
from tests.helpers.processes import free_port, wait_until
from tests.helpers.sentinel_group import SentinelGroup
from workers.process.acks import write_ack


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


ANY = Proof(("PING",))  # a write that is always there (the tests here are about the waiting)


def test_no_wait_without_replicas_or_when_turned_off(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.delenv("PIPELINE_REDIS_WAIT_REPLICAS", raising=False)
    assert replicated(connect_redis(redis_url), "a write", ANY) is None  # auto: a master without replicas
    assert replicated(fakeredis.FakeRedis(), "a write", ANY) is None  # no INFO at all: nothing to wait for
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "0")
    assert wanted_replicas(fakeredis.FakeRedis()) == 0
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "some")
    with pytest.raises(ValueError, match="PIPELINE_REDIS_WAIT_REPLICAS='some': use auto, 0"):
        replicated(fakeredis.FakeRedis(), "a write", ANY)
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "0")
    with pytest.raises(ValueError, match="PIPELINE_REDIS_WAIT_TIMEOUT_MS='0'"):
        replicated(fakeredis.FakeRedis(), "a write", ANY)


def test_acknowledged_writes_are_on_the_replica_when_they_return(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, master_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = master_and_replica
    monkeypatch.delenv("PIPELINE_REDIS_WAIT_REPLICAS", raising=False)  # auto: every replica it has (one)
    conn, copy = connect_redis(master.url), replica.client()
    assert wanted_replicas(conn) == 1
    plan = submit_requests(conn, [RolloutRequest(id="r0", input_ids=[1, 2])], run="rep",
                           output=f"file://{tmp_path}/shards")
    assert copy.hget(keys.batch(plan.batch_id), "job_ids").decode() == ",".join(plan.job_ids)
    assert commit_log.append(conn, "rep", Commit(plan.job_ids[0], plan.batch_id, "file:///x.parquet", 1, 3, 0))
    assert copy.xlen(keys.commit_log("rep")) == 1
    state = control_channel.pause(conn)
    assert copy.get(keys.pool(None).control_state).decode() == control_channel.encode_state(state, keys.pool(None).name)
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
    with caplog.at_level(logging.WARNING, logger="pipeline.core.broker.replication"):
        assert replicated(conn, "the test's write", ANY) == 0
    sleeper.join()
    assert "the test's write: written on the Redis master but 0 of 1 replica(s) confirmed it within 200 ms" \
        in caplog.text
    assert replicated(conn, "the next write", ANY) == 1  # the replica is back


def test_a_write_the_master_does_not_have_is_reported_lost(
    monkeypatch: pytest.MonkeyPatch, master_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    master, _ = master_and_replica
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "1")
    conn = connect_redis(master.url)
    conn.set("written", 1)
    assert replicated(conn, "the write", Proof(("EXISTS", "written"))) == 1
    with pytest.raises(WriteLostError, match="the other write: lost in a Redis failover"):
        replicated(conn, "the other write", Proof(("EXISTS", "never-written")))


@pytest.fixture
def cut_off_replica(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[SentinelGroup, int, int]]:
    """A Sentinel group whose only replica has just been cut off from its master (as a network
    partition would): whatever the master takes now is lost if it dies. Yields the group, the
    master's port and the replica's; acknowledged writes wait for one replica, 3 s at most."""
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "3000")
    group = SentinelGroup(tmp_path / "sentinel", replicas=1, down_after_ms=500, failover_timeout_ms=1000)
    with group:
        old = group.master_port()
        (replica,) = [port for port in group.servers if port != old]
        group.servers[replica].client().execute_command("REPLICAOF", "127.0.0.1", free_port())
        yield group, old, replica


def _kill_once(group: SentinelGroup, port: int, written: Callable[[redis.Redis], bool]) -> None:
    """SIGKILL the master on `port` as soon as `written` holds on it."""
    wait_until(lambda: written(group.servers[port].client()), what="the write on the master")
    group.kill_master()


def test_a_commit_lost_with_its_master_is_appended_again_on_the_new_one(
    cut_off_replica: tuple[SentinelGroup, int, int], caplog: pytest.LogCaptureFixture,
) -> None:
    """A real failover that loses a write: a commit is appended on the master, which is SIGKILLed
    while the commit waits for a replica. The sentinels promote the replica, which never had the
    commit: the wait notices it there and the append is made again, so the commit is on the new
    master, once."""
    group, old, replica = cut_off_replica
    conn = connect_redis(group.url, reconnect_for_s=30)
    commit = Commit("job-0", "b", "file:///shard.parquet", 3, 9, 0)
    appended: list[bool] = []
    appending = threading.Thread(target=lambda: appended.append(commit_log.append(conn, "lost", commit)))
    with caplog.at_level(logging.WARNING, logger="pipeline.core.broker.replication"):
        appending.start()
        _kill_once(group, old, lambda master: master.xlen(keys.commit_log("lost")) == 1)
        appending.join(timeout=60)
    assert appended == [True]
    assert "commit of job job-0 in run 'lost' was lost in a Redis failover; writing it again (1/3)" in caplog.text
    assert group.wait_for_failover(old) == replica
    new = group.servers[replica].client()
    assert [(c.job_id, c.rows) for c in commit_log.read_all(new, "lost")] == [("job-0", 3)]
    assert commit_log.totals(new, "lost").shards == 1


def test_a_control_change_lost_with_its_master_is_applied_again(
    cut_off_replica: tuple[SentinelGroup, int, int],
) -> None:
    """A pause written on a master that dies before any replica has it is applied again to the new
    master's state, past its generation: workers, which refuse older generations, follow it."""
    group, old, replica = cut_off_replica
    conn = connect_redis(group.url, reconnect_for_s=30)
    before = control_channel.read_state(conn)
    states: list[control_channel.DesiredState] = []
    pausing = threading.Thread(target=lambda: states.append(control_channel.pause(conn)))
    pausing.start()
    _kill_once(group, old, lambda master: control_channel.read_state(master).paused)
    pausing.join(timeout=60)
    (state,) = states
    assert group.wait_for_failover(old) == replica
    durable = control_channel.read_state(group.servers[replica].client())
    assert durable == state and durable.paused and durable.generation > before.generation


def test_a_submit_lost_with_its_master_is_submitted_again_into_the_same_run(
    cut_off_replica: tuple[SentinelGroup, int, int], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The enqueue of a whole batch lost in a failover: `submit_requests` finds the new master
    without it and submits again (same run, a new batch): every job is queued exactly once."""
    group, old, replica = cut_off_replica
    conn = connect_redis(group.url, reconnect_for_s=30)
    requests = [RolloutRequest(id=f"r{i}", input_ids=[1, 2]) for i in range(3)]
    plans: list[SubmitPlan] = []
    submitting = threading.Thread(target=lambda: plans.append(submit_requests(
        conn, requests, run="again", output=f"file://{tmp_path}/shards", batch_size=2)))
    with caplog.at_level(logging.WARNING, logger="pipeline.submit.enqueue"):
        submitting.start()
        _kill_once(group, old, lambda master: bool(master.keys("pipeline:batch:*")))
        submitting.join(timeout=60)
    (plan,) = plans
    assert "was enqueued on a Redis master that failed over before any replica had it" in caplog.text
    assert group.wait_for_failover(old) == replica
    new = group.servers[replica].client()
    assert [k.decode() for k in new.keys("pipeline:batch:*")] == [keys.batch(plan.batch_id)]  # the lost one is gone
    assert plan.run == "again" and new.smembers(keys.run_batches("again")) == {plan.batch_id.encode()}
    queued = [j.decode() for j in new.lrange(rollout_queue(new).key, 0, -1)]
    assert sorted(queued) == sorted(plan.job_ids) and len(plan.job_ids) == 2


@pytest.fixture
def two_replicas(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[SentinelGroup, int, int, int]]:
    """A Sentinel group with two replicas (sentinels slow to judge, so that only the test fails
    over), and a client counting both; yields the group and the master's and replicas' ports."""
    monkeypatch.delenv("PIPELINE_REDIS_WAIT_REPLICAS", raising=False)  # auto: every replica the master has
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "1500")
    with SentinelGroup(tmp_path / "sentinel", replicas=2, down_after_ms=30000, failover_timeout_ms=60000) as group:
        master = group.master_port()
        first, second = (port for port in group.servers if port != master)
        yield group, master, first, second


def _write(conn: redis.Redis, key: str) -> int | None:
    conn.set(key, 1)
    return replicated(conn, f"the write of {key}", Proof(("EXISTS", key)))


def test_a_replica_promoted_away_from_the_master_is_still_waited_for(
    two_replicas: tuple[SentinelGroup, int, int, int], caplog: pytest.LogCaptureFixture,
) -> None:
    """The first step of a failover from a master that still answers: the sentinels promote a
    replica (`REPLICAOF NO ONE`), and only a second or so later name it. Meanwhile the old master
    takes writes, and its other replica confirms them, until that replica follows the new master
    and drops them. A client that counts the master's replicas again then must not wait for one
    fewer: the write is not acknowledged on the other replica's word. (Before, it was, and CI's
    chaos run lost a whole submit that way.)"""
    group, master, promoted, _ = two_replicas
    conn = connect_redis(group.url)
    assert _write(conn, "before") == 2
    group.servers[promoted].client().execute_command("REPLICAOF", "NO", "ONE")
    wait_until(lambda: group.servers[master].client().info("replication")["connected_slaves"] == 1,
               what="the promoted replica to leave its master")
    assert wanted_replicas(conn, fresh=True) == 2
    with caplog.at_level(logging.WARNING, logger="pipeline.core.broker.replication"):
        assert _write(conn, "during") == 1
    assert "the write of during: written on the Redis master but 1 of 2 replica(s) confirmed it" in caplog.text


def test_a_dead_replica_is_not_waited_for(
    two_replicas: tuple[SentinelGroup, int, int, int], caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica that dies lowers the count at once (no wait for it, no warning): only one that
    answers as a master, or as another master's replica, keeps it."""
    group, master, _, dead = two_replicas
    conn = connect_redis(group.url)
    assert _write(conn, "before") == 2
    os.kill(int((group.servers[dead].directory / "redis.pid").read_text()), signal.SIGKILL)
    wait_until(lambda: group.servers[master].client().info("replication")["connected_slaves"] == 1,
               what="the master to lose its replica")
    with caplog.at_level(logging.WARNING, logger="pipeline.core.broker.replication"):
        assert wanted_replicas(conn, fresh=True) == 1
        assert _write(conn, "after") == 1
    assert "replica(s) confirmed" not in caplog.text


def _busy(server: RedisServer) -> bool:
    try:
        redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.05, retry=Retry(NoBackoff(), 0)).ping()
    except redis.TimeoutError:
        return True
    return False


def _rewriting(server: RedisServer) -> bool:
    info = server.client().info("persistence")
    return bool(info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"] or info["rdb_bgsave_in_progress"])
