"""Workers' turn queues (Redis streams read through one consumer group): entries read first in,
first out, acknowledged, retried, handed back, failed; a dead worker's entries taken over by a live
one, each by one worker only; an empty dead queue forgotten (a real redis-server)."""

from __future__ import annotations

import time

import redis

from pipeline.core.broker import keys, registry
from pipeline.core.jobs import turn_queue
from pipeline.core.jobs.turn_queue import TURNS
from schemas.turn_failure import TurnFailure
from schemas.worker_info import WorkerInfo
from tests.helpers.turn_jobs import answers, push, turn_job

POOL = keys.pool(None)


def alive(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="sim", model="m",
                                      started_at=now, heartbeat_at=now))


def _read(conn: redis.Redis, worker: str, reader: str | None = None) -> list:
    return TURNS.read_new(conn, [POOL.turn_queue(worker)], reader or worker, 1, None)


def test_an_entry_is_read_once_in_order_and_leaves_its_queue_when_done(redis_client: redis.Redis) -> None:
    turn_queue.register(redis_client, POOL, "w")
    first, second = turn_job("job-1", "t1", "t2"), turn_job("job-2", "t3")
    push(redis_client, "w", first)
    push(redis_client, "w", second)
    assert turn_queue.parse_turn_job(redis_client.get(keys.turn_job("t2"))) == ("job-1", "w")
    assert turn_queue.queued(redis_client, POOL, "w") == 2

    [claimed] = _read(redis_client, "w")
    assert claimed.job == first  # first in, first out
    assert _read(redis_client, "w")[0].job == second  # the first is not handed out twice
    turn_queue.done(redis_client, claimed)
    assert turn_queue.queued(redis_client, POOL, "w") == 1  # acknowledged and deleted
    assert _read(redis_client, "w") == []
    assert TURNS.read_new(redis_client, [POOL.turn_queue("w")], "w", 1, 50) == []  # empty: waits, then nothing


def test_a_push_writes_the_entry_before_its_turns_job_keys(redis_client: redis.Redis) -> None:
    # A failover or a restart loses a suffix of the writes: a job key that survives means its entry did.
    with redis_client.monitor() as monitor:
        push(redis_client, "w", turn_job("job-1", "t1", "t2"))
        written = []
        while len(written) < 3:
            command = monitor.next_command()["command"].split()
            if command[0].upper() in ("XADD", "SET"):
                written.append((command[0].upper(), command[1]))
    assert written == [("XADD", POOL.turn_queue("w")), ("SET", keys.turn_job("t1")), ("SET", keys.turn_job("t2"))]


def test_a_retried_entry_waits_its_turn_with_one_retry_fewer(redis_client: redis.Redis) -> None:
    turn_queue.register(redis_client, POOL, "w")
    push(redis_client, "w", turn_job("job-1", "t1"))
    push(redis_client, "w", turn_job("job-2", "t2"))
    [claimed] = _read(redis_client, "w")
    turn_queue.retry(redis_client, claimed)
    assert _read(redis_client, "w")[0].job.job_id == "job-2"
    retried = _read(redis_client, "w")[0].job
    assert (retried.job_id, retried.attempts, retried.retries_left) == ("job-1", 1, 0)
    assert turn_queue.queued(redis_client, POOL, "w") == 2  # the two read, the first retry gone


def test_a_handed_back_entry_is_taken_over_at_once_and_a_held_one_is_not(redis_client: redis.Redis) -> None:
    turn_queue.register(redis_client, POOL, "w")
    push(redis_client, "w", turn_job("job-1", "t1"))
    push(redis_client, "w", turn_job("job-2", "t2"))
    [handed], [held] = _read(redis_client, "w"), _read(redis_client, "w")
    turn_queue.hand_back(redis_client, "w", handed)
    turn_queue.keep(redis_client, "w", [held])
    taken = TURNS.take_over(redis_client, POOL.turn_queue("w"), "w", 15_000, 10)
    assert [c.job.job_id for c in taken] == ["job-1"]  # no retry spent
    assert taken[0].job.retries_left == 1


def test_a_failed_entry_answers_each_turn_with_its_reason(redis_client: redis.Redis) -> None:
    turn_queue.register(redis_client, POOL, "w")
    push(redis_client, "w", turn_job("job-1", "t1", "t2"))
    [claimed] = _read(redis_client, "w")
    failure = TurnFailure.of("UnsupportedRequestError", "top 5 logprobs, this engine serves 0")
    turn_queue.fail(redis_client, claimed, failure)
    answered = answers(redis_client, 2)
    for turn_id in ("t1", "t2"):
        assert TurnFailure.decode(answered[turn_id]) == TurnFailure(
            "unservable", "UnsupportedRequestError: top 5 logprobs, this engine serves 0")
        assert turn_queue.turn_failure(redis_client, turn_id) == failure
    assert turn_queue.queued(redis_client, POOL, "w") == 0
    assert turn_queue.turn_failure(redis_client, "t3") is None


def test_a_dead_workers_entries_are_taken_over_once_and_its_empty_queue_forgotten(redis_client: redis.Redis) -> None:
    for worker in ("alive", "also-alive"):
        alive(redis_client, worker)
    for worker in ("alive", "dead"):
        turn_queue.register(redis_client, POOL, worker)
    for job_id in ("taken", "queued"):
        push(redis_client, "dead", turn_job(job_id, f"turn-of-{job_id}"))
    _read(redis_client, "dead")  # the dead worker had read one
    redis_client.zadd(POOL.homed_sessions("dead"), {"s1": time.time() + 60})
    assert turn_queue.owners(redis_client, POOL, "alive") == ({"alive"}, ["dead"])

    live = {"alive", "also-alive"}
    stream = POOL.turn_queue("dead")
    time.sleep(1.1)  # the take-over's guard: an entry claimed in the last second is not taken from its taker
    taken = TURNS.take_over_from(redis_client, stream, "alive", lambda c: c not in live, 10)
    assert [c.job.job_id for c in taken] == ["taken"]
    assert TURNS.take_over_from(redis_client, stream, "also-alive", lambda c: c not in live, 10) == []  # not twice
    assert _read(redis_client, "dead", "also-alive")[0].job.job_id == "queued"  # no worker had it: read as new
    assert not turn_queue.forget_if_empty(redis_client, POOL, "dead")  # two still run from it
    for claimed in taken:
        turn_queue.done(redis_client, claimed)
    turn_queue.done(redis_client, _pending(redis_client, stream, "also-alive"))
    assert turn_queue.forget_if_empty(redis_client, POOL, "dead")
    assert not redis_client.exists(stream, POOL.homed_sessions("dead"))
    assert redis_client.smembers(POOL.turn_queue_owners) == {b"alive"}


def _pending(conn: redis.Redis, stream: str, consumer: str):
    [entry] = conn.xpending_range(stream, TURNS.group, "-", "+", 1, consumername=consumer)
    [(entry_id, fields)] = conn.xrange(stream, entry["message_id"], entry["message_id"])
    return TURNS._claimed(conn, stream, [(entry_id, fields)])[0]


def test_an_entry_that_is_no_job_is_dropped_not_read_for_ever(redis_client: redis.Redis) -> None:
    turn_queue.register(redis_client, POOL, "w")
    redis_client.xadd(POOL.turn_queue("w"), {"job": b"not json"})
    push(redis_client, "w", turn_job("job-1", "t1"))
    assert _read(redis_client, "w") == []
    assert _read(redis_client, "w")[0].job.job_id == "job-1"
    assert turn_queue.queued(redis_client, POOL, "w") == 1
