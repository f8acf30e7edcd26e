"""A worker's lane keeper: its own lane registered every round; a dead neighbour's turns moved by
one worker of the pool a round (a claim), not by every worker (a real redis-server: the moves
are Lua scripts)."""

from __future__ import annotations

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys
from pipeline.core.jobs import lanes
from tests.helpers.lanes import item, push
from tests.pipeline.core.jobs.test_lanes import _alive
from workers.process.lane_keeper import LaneKeeper

POOL = keys.pool(None)


def test_one_keeper_a_round_moves_a_dead_workers_turns_and_every_keeper_keeps_its_lane(
        redis_client: redis.Redis) -> None:
    for worker in ("w1", "w2"):
        _alive(redis_client, worker)
    lanes.register(redis_client, POOL, "dead")
    push(redis_client, "dead", orphan := item("orphan", "t1"))
    first, second = (LaneKeeper(redis_client, POOL, worker, interval_s=60) for worker in ("w1", "w2"))

    redis_client.set(POOL.lane_rehome_claim, "w2", px=60_000)  # w2 claimed this round
    first.tend()
    assert redis_client.sismember(POOL.lane_workers, "w1")  # its own lane, whoever does the chore
    assert redis_client.lrange(POOL.turn_lane("dead"), 0, -1) == [orphan.encode()]

    redis_client.delete(POOL.lane_rehome_claim)  # the round is over
    first.tend()
    shared = Queue(POOL.lane_queue_name, connection=redis_client, serializer=JSONSerializer)
    assert shared.get_job_ids() == [orphan.job_id]
    assert redis_client.get(POOL.lane_rehome_claim) == b"w1"
    second.tend()  # within w1's round: registers its lane, moves nothing (nothing left anyway)
    assert redis_client.smembers(POOL.lane_workers) == {b"w1", b"w2"}
