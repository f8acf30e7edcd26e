"""A worker's own lane: turns routed to it are served with no RQ record, failures reach each turn's
server (at once for a request it cannot serve, after one retry otherwise), and a paused pool's
worker takes nothing from it until resumed (a real redis-server, the worker in this process)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import redis
from rq.job import Job

import pipeline
from pipeline.core.broker import keys
from pipeline.core.jobs import lanes
from pipeline.core.jobs.queue import job_args
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.shard import rows_from_ipc
from schemas.turn_failure import TurnFailure
from tests.helpers.lanes import SERVER, answers, item, push
from tests.helpers.processes import wait_until
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker

POOL = keys.pool(None)


def _serve(conn: redis.Redis, worker: RolloutWorker, driver: Callable[[], None]) -> None:
    """Run `worker` in this thread (RQ's signal handlers need it) while `driver` runs beside it;
    the worker is stopped (SIGTERM) once the driver returns or raises."""
    failure: list[BaseException] = []
    default = signal.getsignal(signal.SIGTERM)

    def drive() -> None:
        try:
            # RQ's handlers are in place (the SIGTERM below is the worker's warm shutdown, not the end
            # of this process): the own lane's thread may answer a turn before the work loop starts.
            wait_until(lambda: signal.getsignal(signal.SIGTERM) is not default, 30, "the worker's signal handlers")
            driver()
        except BaseException as exc:  # reported by the test, after the worker stopped
            failure.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=drive)
    thread.start()
    worker.work(burst=False, with_scheduler=False, logging_level="WARNING")
    thread.join(timeout=30)
    if failure:
        raise failure[0]


def _reply(conn: redis.Redis, turn_id: str) -> bytes:
    return answers(conn)[turn_id]


def test_a_turn_in_a_workers_own_lane_is_answered_with_no_rq_record(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)
    turn = item("lane-1", "t1")

    def driver() -> None:
        push(redis_client, "w1", turn)
        rows = rows_from_ipc(_reply(redis_client, "t1")).to_pylist()
        assert [(r["session_id"], r["turn"], r["worker_id"]) for r in rows] == [("s-t1", 0, "w1")]

    _serve(redis_client, worker, driver)
    assert redis_client.llen(POOL.turn_lane_in_flight("w1")) == 0 and redis_client.llen(POOL.turn_lane("w1")) == 0
    assert not redis_client.exists(Job.key_for("lane-1"))  # no RQ job: no hash, registry, result
    assert not redis_client.keys("rq:*lane-1*")


def test_a_request_the_worker_cannot_serve_fails_its_turn_at_once_with_400(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0), worker_id="w1", control_poll_s=0.1)
    request = RolloutRequest.model_validate({"id": "s:0", "input_ids": [1, 2], "logprobs": 5})
    payload = JobPayload.pack([request], run="r", job_id="lane-1", batch_id="lane-1", output="file:///tmp/out",
                              submitted_at_ms=0, turns=[TurnTag(turn_id="t1", session_id="s", turn=0, reply_to=SERVER)])

    def driver() -> None:
        push(redis_client, "w1", lanes.new_item("lane-1", job_args(payload), {}, "1 turn", timeout_s=60, retries=1))
        failure = TurnFailure.decode(_reply(redis_client, "t1"))
        assert failure is not None and failure.code == "unservable"
        assert "Unsupported" in failure.reason and "logprobs" in failure.reason

    _serve(redis_client, worker, driver)
    recorded = lanes.turn_failure(redis_client, "t1")
    assert recorded is not None and recorded.code == "unservable"
    assert redis_client.llen(POOL.turn_lane_in_flight("w1")) == 0
    assert redis_client.llen(POOL.turn_lane("w1")) == 0  # not retried: every retry would be refused too


def test_a_failing_turn_is_retried_once_then_its_server_gets_the_error(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)
    request = RolloutRequest.model_validate({"id": "s:0", "input_ids": [1, 2]})
    # Its prompt ids live beside the job in Redis, and are gone: the job fails each time it runs.
    payload, _ = JobPayload.pack_beside([request], prompt_key=keys.prompts("lane-1"), run="r", job_id="lane-1",
                                        batch_id="lane-1", output="file:///tmp/out", submitted_at_ms=0,
                                        turns=[TurnTag(turn_id="t1", session_id="s", turn=0, reply_to=SERVER)])

    def driver() -> None:
        push(redis_client, "w1", lanes.new_item("lane-1", job_args(payload), {}, "1 turn", timeout_s=60, retries=1))
        failure = TurnFailure.decode(_reply(redis_client, "t1"))
        assert failure is not None and failure.code == "failed" and "gone from Redis" in failure.reason

    _serve(redis_client, worker, driver)
    outcomes = {outcome: worker.metrics.registry.get_sample_value(
        "pipeline_worker_jobs_total", {"worker": "w1", "engine": "fake", "outcome": outcome}) for outcome in
        ("retried", "failed")}
    assert outcomes == {"retried": 1, "failed": 1}
    assert redis_client.llen(POOL.turn_lane_in_flight("w1")) == 0 and redis_client.llen(POOL.turn_lane("w1")) == 0


def test_a_paused_pools_worker_takes_no_turn_until_resumed(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    client.pause()
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)

    def driver() -> None:
        push(redis_client, "w1", item("lane-1", "t1"))
        assert redis_client.blpop([keys.serve_inbox(SERVER)], timeout=1.5) is None  # paused: not taken
        assert redis_client.llen(POOL.turn_lane("w1")) == 1
        client.resume()
        rows_from_ipc(_reply(redis_client, "t1"))

    _serve(redis_client, worker, driver)


def test_a_quiet_lane_blocks_within_the_connections_read_timeout(redis_url: str) -> None:
    """RQ gives the worker's connections a read timeout (11 s with a 1 s maintenance interval): a take
    on a quiet lane blocks for half of it at most, so a busy worker's late read is no TimeoutError."""
    conn = redis.Redis.from_url(redis_url)
    worker = RolloutWorker(conn, FakeEngine(), worker_id="w1", maintenance_interval_s=1)
    read_timeout = conn.connection_pool.connection_kwargs["socket_timeout"]
    assert worker.own_lane._block_s() == min(10.0, read_timeout / 2)


def test_an_item_moved_as_the_takes_reply_was_lost_goes_back_to_the_lane(redis_client: redis.Redis) -> None:
    """A take whose reply never came (a read timeout, a dropped connection) after Redis moved the
    item: the item is in the in-flight list, held by no job; the lane thread puts it back."""
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1")
    push(redis_client, "w1", item("lane-1", "t1"))
    lanes.take(redis_client, POOL, "w1", 1)  # moved; its reply "lost": nothing admitted it
    worker.own_lane._reclaim()
    assert redis_client.llen(POOL.turn_lane_in_flight("w1")) == 0
    back = lanes.LaneItem.decode(redis_client.lindex(POOL.turn_lane("w1"), -1))
    assert (back.job_id, back.attempts) == ("lane-1", 1)
