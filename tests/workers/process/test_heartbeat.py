"""A worker's registry entry: a change is visible at once, an update that changes nothing writes
nothing (an idle worker's control reads used to rewrite it every second), membership rides the
heartbeat.

Single process, Redis semantics only: fakeredis.
"""

from __future__ import annotations

import fakeredis

from pipeline.core.broker import keys, registry
from workers.engines.fake import FakeEngine
from workers.process.heartbeat import Heartbeat, worker_info


class Counting(fakeredis.FakeRedis):
    """fakeredis that counts the commands sent to it (pipelined ones included)."""

    commands = 0

    def execute_command(self, *args, **options):  # type: ignore[no-untyped-def]
        Counting.commands += 1
        return super().execute_command(*args, **options)

    def pipeline(self, transaction=True, shard_hint=None):  # type: ignore[no-untyped-def]
        pipe = super().pipeline(transaction, shard_hint)
        original = pipe.execute

        def execute(raise_on_error: bool = True):  # type: ignore[no-untyped-def]
            Counting.commands += len(pipe.command_stack)
            return original(raise_on_error)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe


def beat(conn: fakeredis.FakeRedis) -> Heartbeat:
    return Heartbeat(conn, worker_info("w1", "default", FakeEngine()), interval_s=5, jobs=list,
                     beat_job=lambda job, execution: None)


def test_a_state_change_is_published_at_once_and_an_unchanged_update_writes_nothing() -> None:
    conn = Counting()
    heartbeat = beat(conn)
    heartbeat.update(state="idle")  # the first publish: the entry and the pool's membership
    (entry,) = registry.live_workers(conn, "default")
    assert entry.state == "idle" and conn.sismember(keys.pool("default").workers, "w1")
    written = conn.get(keys.pool("default").worker("w1"))
    before = Counting.commands
    for _ in range(5):
        heartbeat.update(state="idle", current_job=None)
    assert Counting.commands == before and conn.get(keys.pool("default").worker("w1")) == written
    before = Counting.commands
    heartbeat.update(state="busy", current_job="job-1")
    assert Counting.commands == before + 1  # the entry alone
    (entry,) = registry.live_workers(conn, "default")
    assert (entry.state, entry.current_job) == ("busy", "job-1")


def test_membership_lost_with_redis_comes_back_with_the_heartbeat() -> None:
    conn = Counting()
    heartbeat = beat(conn)
    heartbeat.update(state="idle")
    conn.delete(keys.pool("default").workers)  # a Redis restored without the set, or a prune
    heartbeat.update(state="busy")
    assert not conn.sismember(keys.pool("default").workers, "w1")
    heartbeat.publish()  # what the heartbeat thread does every interval
    assert [w.worker_id for w in registry.live_workers(conn, "default")] == ["w1"]
