"""Workers' own lanes: a dead worker's lane jobs move to the shared lane, a live one's stay
(a real redis-server: the moves are Lua scripts)."""

from __future__ import annotations

import time

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys, registry
from pipeline.core.jobs import lanes
from schemas.worker_info import WorkerInfo

POOL = keys.pool(None)


def _enqueue(conn: redis.Redis, queue: Queue, job_id: str) -> Job:
    return queue.enqueue_call("workers.jobs.batch_job.run_batch", args=({},), job_id=job_id)


def _alive(conn: redis.Redis, worker_id: str) -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, host="h", pid=1, engine="sim", model="m",
                                      started_at=now, heartbeat_at=now))


def test_a_dead_workers_lane_jobs_move_to_the_front_of_the_shared_lane(redis_client: redis.Redis) -> None:
    _alive(redis_client, "alive")
    for worker in ("alive", "dead"):
        lanes.register(redis_client, POOL, worker)
    shared = Queue(POOL.lane_queue_name, connection=redis_client, serializer=JSONSerializer)
    _enqueue(redis_client, shared, "waiting-already")
    dead = lanes.worker_queue(redis_client, POOL, "dead")
    queued = _enqueue(redis_client, dead, "queued-on-dead")
    running = _enqueue(redis_client, dead, "running-on-dead")
    redis_client.lrem(dead.key, 1, running.id)  # the dead worker had taken and started it
    redis_client.zadd(dead.started_job_registry.key, {f"{running.id}:exec1": time.time() + 60})
    redis_client.hset(running.key, "status", "started")
    mine = _enqueue(redis_client, lanes.worker_queue(redis_client, POOL, "alive"), "queued-on-alive")
    redis_client.zadd(POOL.lane_load("dead"), {"s1": time.time() + 60})

    assert lanes.rehome_orphans(redis_client, POOL) == 2
    assert set(shared.get_job_ids()[:2]) == {queued.id, running.id}  # ahead of what waited there
    assert shared.get_job_ids()[2] == "waiting-already"
    for job_id in (queued.id, running.id):
        assert redis_client.hget(Job.key_for(job_id), "status") == b"queued"
        assert redis_client.hget(Job.key_for(job_id), "origin").decode() == shared.name
    assert not redis_client.exists(dead.key, dead.started_job_registry.key, POOL.lane_load("dead"))
    assert redis_client.smembers(POOL.lane_workers) == {b"alive"}
    assert lanes.worker_queue(redis_client, POOL, "alive").get_job_ids() == [mine.id]
    assert lanes.rehome_orphans(redis_client, POOL) == 0  # nothing twice


def test_a_job_popped_by_a_worker_that_died_before_starting_it_is_rescued(redis_client: redis.Redis) -> None:
    dead = lanes.worker_queue(redis_client, POOL, "dead")
    popped = _enqueue(redis_client, dead, "popped")
    redis_client.lrem(dead.key, 1, popped.id)  # BLPOP took it; the worker died before starting it
    assert not lanes.rescue_popped(redis_client, POOL, popped.id, live={"dead"})  # its worker lives: not ours
    assert lanes.rescue_popped(redis_client, POOL, popped.id, live=set())
    shared = Queue(POOL.lane_queue_name, connection=redis_client, serializer=JSONSerializer)
    assert shared.get_job_ids() == [popped.id]
    assert not lanes.rescue_popped(redis_client, POOL, popped.id, live=set())  # once
