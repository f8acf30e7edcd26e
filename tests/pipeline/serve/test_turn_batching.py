"""Turns that reach a server together travel together (`TurnBatcher`, on the server's loop): while the
server's jobs keep the pool's workers busy, turns arriving within `HOLD_S` share one job; a turn
reaching an idle pool is enqueued at once, in a job of its own (a real redis-server, the server's
asyncio client and, where it has none, the sync one in a thread)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from pipeline.core.broker import keys, registry
from pipeline.core.broker.connection import asyncio_twin
from pipeline.core.broker.work_streams import JOB_FIELD
from pipeline.core.jobs import turn_queue
from pipeline.serve.routing import Router
from pipeline.serve.turn_batching import TurnBatcher, WaitingTurn
from schemas.capabilities import NO_NEEDS
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from schemas.turn_job import TurnJob
from schemas.worker_info import WorkerInfo

POOL = keys.pool(None)


def _waiting(n: int) -> WaitingTurn:
    request = RolloutRequest.model_validate({"id": f"s{n}:0", "input_ids": [1, 2, 3]})
    turn = TurnTag(turn_id=f"s{n}-00000-abcdef", session_id=f"s{n}", turn=0, reply_to="server")
    return WaitingTurn(request, turn, "r", "file:///tmp/out", NO_NEEDS, ("r", "out", (), "w1"), "w1", None)


def _jobs(conn: redis.Redis) -> list[TurnJob]:
    return [TurnJob.decode(fields[JOB_FIELD]) for _, fields in conn.xrange(POOL.turn_queue("w1"))]


@pytest.mark.parametrize("asyncio_client", [True, False])
def test_turns_share_a_job_while_the_workers_are_busy_and_go_at_once_when_idle(
        redis_client: redis.Redis, asyncio_client: bool) -> None:
    now = time.time()
    registry.publish(redis_client, WorkerInfo(worker_id="w1", host="h", pid=1, engine="sim", model="m",
                                              started_at=now, heartbeat_at=now))

    async def scenario() -> None:
        aconn = asyncio_twin(redis_client) if asyncio_client else None
        batcher = TurnBatcher(redis_client, Router(redis_client, POOL), async_conn=lambda: aconn)
        await batcher.enqueue(_waiting(0))  # idle: at once, alone
        await batcher.enqueue(_waiting(1))  # one job in flight is not enough to keep one worker busy
        assert [job.turn_ids for job in _jobs(redis_client)] == [["s0-00000-abcdef"], ["s1-00000-abcdef"]]
        # Busy: the first turn is held (up to HOLD_S) for others to join its job.
        first = asyncio.get_running_loop().create_task(batcher.enqueue(_waiting(2)))
        for _ in range(5):  # the flusher has taken it up
            await asyncio.sleep(0)
        assert not first.done() and batcher._waiting
        await asyncio.gather(first, *(batcher.enqueue(_waiting(n)) for n in range(3, 6)))
        jobs = _jobs(redis_client)
        assert [len(job.turn_ids) for job in jobs] == [1, 1, 4]
        assert turn_queue.parse_turn_job(redis_client.get(keys.turn_job("s5-00000-abcdef"))) == (jobs[2].job_id,
                                                                                                 "w1")
        for n in range(6):  # answered: the workers are idle again
            batcher.answered(f"s{n}-00000-abcdef")
        await batcher.enqueue(_waiting(6))
        assert [len(job.turn_ids) for job in _jobs(redis_client)] == [1, 1, 4, 1]
        assert redis_client.zcard(POOL.homed_sessions("w1")) == 7
        if aconn is not None:
            await aconn.aclose()

    asyncio.run(scenario())
