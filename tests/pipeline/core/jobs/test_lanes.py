"""Workers' own lanes: items taken into an in-flight list, handed back, retried, failed; a dead
worker's items become RQ jobs at the front of the shared lane, a live one's stay (a real
redis-server: the moves are Lua scripts)."""

from __future__ import annotations

import time

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys, registry
from pipeline.core.jobs import lanes
from schemas.turn_failure import TurnFailure
from schemas.worker_info import WorkerInfo
from tests.helpers.lanes import answers, item, push

POOL = keys.pool(None)


def _alive(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="sim", model="m",
                                      started_at=now, heartbeat_at=now))


def test_a_taken_item_is_in_flight_until_done_and_its_turns_know_their_worker(redis_client: redis.Redis) -> None:
    first, second = item("lane-1", "t1", "t2"), item("lane-2", "t3")
    push(redis_client, "w", first)
    push(redis_client, "w", second)
    assert lanes.parse_turn_job(redis_client.get(keys.turn_job("t2"))) == ("lane-1", "w")
    assert lanes.queued(redis_client, POOL, "w") == 2

    raw = lanes.take(redis_client, POOL, "w", 1)
    assert raw is not None and lanes.LaneItem.decode(raw) == first  # first in, first out
    assert redis_client.lrange(POOL.turn_lane_in_flight("w"), 0, -1) == [raw]
    lanes.done(redis_client, POOL, "w", raw)
    assert redis_client.llen(POOL.turn_lane_in_flight("w")) == 0
    assert lanes.LaneItem.decode(lanes.take(redis_client, POOL, "w", 1)) == second
    assert lanes.take(redis_client, POOL, "w", 0.05) is None  # empty: waits, then None


def test_a_handed_back_item_is_taken_next_and_a_retried_one_waits_its_turn(redis_client: redis.Redis) -> None:
    push(redis_client, "w", item("lane-1", "t1"))
    push(redis_client, "w", item("lane-2", "t2"))
    raw = lanes.take(redis_client, POOL, "w", 1)
    assert lanes.hand_back(redis_client, POOL, "w", raw, lanes.LaneItem.decode(raw))
    again = lanes.LaneItem.decode(lanes.take(redis_client, POOL, "w", 1))
    assert (again.job_id, again.attempts, again.retries_left) == ("lane-1", 1, 1)  # no retry spent

    raw = redis_client.lindex(POOL.turn_lane_in_flight("w"), 0)
    assert lanes.retry(redis_client, POOL, "w", raw, again)
    assert not lanes.retry(redis_client, POOL, "w", raw, again)  # no longer in flight: not queued twice
    assert lanes.LaneItem.decode(lanes.take(redis_client, POOL, "w", 1)).job_id == "lane-2"
    retried = lanes.LaneItem.decode(lanes.take(redis_client, POOL, "w", 1))
    assert (retried.job_id, retried.attempts, retried.retries_left) == ("lane-1", 2, 0)


def test_a_push_writes_the_item_before_its_turns_job_keys(redis_client: redis.Redis) -> None:
    # A failover or a restart loses a suffix of the writes: a job key that survives means its item did.
    with redis_client.monitor() as monitor:
        push(redis_client, "w", item("lane-1", "t1", "t2"))
        written = []
        while len(written) < 3:
            command = monitor.next_command()["command"].split()
            if command[0].upper() in ("LPUSH", "SET"):
                written.append((command[0].upper(), command[1]))
    assert written == [("LPUSH", POOL.turn_lane("w")), ("SET", keys.turn_job("t1")), ("SET", keys.turn_job("t2"))]


def test_a_failed_item_answers_each_turn_with_its_reason(redis_client: redis.Redis) -> None:
    failing = item("lane-1", "t1", "t2")
    push(redis_client, "w", failing)
    raw = lanes.take(redis_client, POOL, "w", 1)
    failure = TurnFailure.of("UnsupportedRequestError", "top 5 logprobs, this engine serves 0")
    lanes.fail(redis_client, POOL, "w", raw, failing, failure)
    answered = answers(redis_client, 2)
    for turn_id in ("t1", "t2"):
        assert TurnFailure.decode(answered[turn_id]) == TurnFailure(
            "unservable", "UnsupportedRequestError: top 5 logprobs, this engine serves 0")
        assert lanes.turn_failure(redis_client, turn_id) == failure
    assert redis_client.llen(POOL.turn_lane_in_flight("w")) == 0
    assert lanes.turn_failure(redis_client, "t3") is None


def test_a_dead_workers_items_become_rq_jobs_at_the_front_of_the_shared_lane(redis_client: redis.Redis) -> None:
    _alive(redis_client, "alive")
    for worker in ("alive", "dead"):
        lanes.register(redis_client, POOL, worker)
    shared = Queue(POOL.lane_queue_name, connection=redis_client, serializer=JSONSerializer)
    shared.enqueue_call("workers.jobs.batch_job.run_rollout_batch", args=({},), job_id="waiting-already")
    for job_id in ("taken-first", "taken-next", "queued"):
        push(redis_client, "dead", item(job_id, f"turn-of-{job_id}"))
    lanes.take(redis_client, POOL, "dead", 1)
    lanes.take(redis_client, POOL, "dead", 1)  # the dead worker had taken two
    push(redis_client, "alive", mine := item("mine", "turn-of-mine"))
    redis_client.zadd(POOL.lane_load("dead"), {"s1": time.time() + 60})

    assert lanes.rehome_orphans(redis_client, POOL) == 3
    # Oldest first, ahead of what waited there.
    assert shared.get_job_ids() == ["taken-first", "taken-next", "queued", "waiting-already"]
    job = Job.fetch("taken-first", connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() == "queued" and job.origin == shared.name
    assert job.func_name == "workers.jobs.batch_job.run_rollout_batch"
    assert job.args[0]["turns"][0]["turn_id"] == "turn-of-taken-first" and job.retries_left == 1
    assert redis_client.get(keys.turn_job("turn-of-taken-first")) == b"taken-first"  # an RQ job from now on
    assert not redis_client.exists(POOL.turn_lane("dead"), POOL.turn_lane_in_flight("dead"), POOL.lane_load("dead"))
    assert redis_client.smembers(POOL.lane_workers) == {b"alive"}
    assert lanes.LaneItem.decode(lanes.take(redis_client, POOL, "alive", 1)) == mine
    assert lanes.rehome_orphans(redis_client, POOL) == 0  # nothing twice


def test_an_item_finished_while_a_rehome_read_it_is_not_moved(redis_client: redis.Redis) -> None:
    """A rehome reads a lane, then moves item by item: an item its worker finished meanwhile (a
    partition ended) stays done, not run again."""
    push(redis_client, "late", done := item("done-meanwhile", "t1"))
    raw = lanes.take(redis_client, POOL, "late", 1)
    script = redis_client.register_script(lanes._MOVE)
    lanes.done(redis_client, POOL, "late", raw)
    assert script(keys=[POOL.turn_lane_in_flight("late"), Job.key_for(done.job_id), "rq:queue:x", "rq:queues"],
                  args=[raw, done.job_id, "rq:queue:x", 60, "status", "queued"]) == 0
    assert not redis_client.exists(Job.key_for(done.job_id), "rq:queue:x")
