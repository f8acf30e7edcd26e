"""A worker's turn queue and the pool's shared lane: turns are served with no RQ record, a lane turn a
worker cannot serve moves to one that can, failures reach each turn's server (once no live worker
can serve it, or after one retry), a paused pool's worker
takes nothing from it until resumed, and what no live worker runs (a dead worker's entries, an
entry whose read's reply was lost) is taken over (a real redis-server, the worker in this process)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import redis
from rq.job import Job

import pipeline
from pipeline.core.broker import keys, registry
from pipeline.core.jobs import turn_queue
from pipeline.core.jobs.turn_queue import TURNS
from schemas.capabilities import needs_of
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.shard import rows_from_ipc
from schemas.turn_failure import TurnFailure
from schemas.worker_info import Capabilities, WorkerInfo
from tests.helpers.processes import wait_until
from tests.helpers.turn_jobs import SERVER, answers, push, turn_job
from tests.pipeline.core.jobs.test_turn_queue import alive
from workers.engines.fake import FakeEngine
from workers.jobs import admission
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
            # of this process): the turn reader may answer a turn before the work loop starts.
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


def test_a_turn_in_a_workers_turn_queue_is_answered_with_no_rq_record(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)
    turn = turn_job("lane-1", "t1")

    def driver() -> None:
        push(redis_client, "w1", turn)
        rows = rows_from_ipc(_reply(redis_client, "t1")).to_pylist()
        assert [(r["session_id"], r["turn"], r["worker_id"]) for r in rows] == [("s-t1", 0, "w1")]

    _serve(redis_client, worker, driver)
    assert turn_queue.queued(redis_client, POOL, "w1") == 0  # acknowledged and deleted
    assert not redis_client.exists(Job.key_for("lane-1"))  # no RQ job: no hash, registry, result
    assert not redis_client.keys("rq:*lane-1*")


def _top5_job(job_id: str, turn_id: str) -> turn_queue.TurnJob:
    """A job of one turn asking for top-5 logprobs, its needs as `pipeline serve` writes them."""
    request = RolloutRequest.model_validate({"id": f"{turn_id}:0", "input_ids": [1, 2], "logprobs": 5})
    payload = JobPayload.pack([request], run="r", job_id=job_id, batch_id=job_id, output="file:///tmp/out",
                              submitted_at_ms=0,
                              turns=[TurnTag(turn_id=turn_id, session_id=f"s-{turn_id}", turn=0, reply_to=SERVER)])
    return turn_queue.new_job(job_id, payload.as_json(), needs_of(request).as_dict(), "1 turn", timeout_s=60,
                              retries=1)


def test_a_turn_no_live_worker_can_serve_fails_with_unservable_once_the_wait_is_over(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission is the worker's one check of what a job needs: nothing runs, no retry is spent, and
    the turn's server gets the reason with the code that `pipeline serve` answers 400 for."""
    monkeypatch.setenv(admission.ENV_UNSERVABLE_WAIT_S, "0")
    worker = RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0), worker_id="w1", control_poll_s=0.1)

    def driver() -> None:
        push(redis_client, None, _top5_job("turns-1", "t1"))
        failure = TurnFailure.decode(_reply(redis_client, "t1"))
        assert failure is not None and failure.code == "unservable"
        assert "no live worker of pool 'default' can serve it: it needs top-5 logprobs (start a worker with " \
               "--max-top-logprobs 5)" in failure.reason

    _serve(redis_client, worker, driver)
    recorded = turn_queue.turn_failure(redis_client, "t1")
    assert recorded is not None and recorded.code == "unservable"
    assert turn_queue.queued(redis_client, POOL, None) == 0  # not retried: every retry would be refused too


def test_a_turn_no_live_worker_can_serve_waits_for_one_then_fails(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Within the wait, the job is handed back (a worker that can may be starting) and looked at again
    at each claim of the lane; past it, it fails."""
    monkeypatch.setenv(admission.ENV_UNSERVABLE_WAIT_S, "1")
    worker = RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0), worker_id="w1", control_poll_s=0.1)
    reader = worker.turn_reader
    reader.claim_after_s = reader.take_over_s = 0.2

    def driver() -> None:
        push(redis_client, None, _top5_job("turns-1", "t1"))
        failure = TurnFailure.decode(_reply(redis_client, "t1"))
        assert failure is not None and failure.code == "unservable"
        waited = int(failure.reason.split("waited ")[1].split(" s")[0])
        assert waited >= 1

    with caplog.at_level(logging.WARNING, logger="workers.process.turn_reader"):
        _serve(redis_client, worker, driver)
    assert "turn job turns-1 waits for a worker that can serve it" in caplog.text


def test_a_lane_turn_its_reader_cannot_serve_moves_to_a_live_worker_that_can(redis_client: redis.Redis) -> None:
    """The pool's shared lane is read by every worker; one that lacks what a job needs hands it to a
    live worker that has it (its turn queue), and the turn's job key follows it."""
    now = time.time()
    registry.publish(redis_client, WorkerInfo(worker_id="w2", host="h", pid=1, engine="sim", model="m",
                                              started_at=now, heartbeat_at=now,
                                              capabilities=Capabilities(max_top_logprobs=5)))
    worker = RolloutWorker(redis_client, FakeEngine(max_top_logprobs=0), worker_id="w1", control_poll_s=0.1)

    def driver() -> None:
        push(redis_client, None, _top5_job("turns-1", "t1"))
        wait_until(lambda: turn_queue.queued(redis_client, POOL, "w2") == 1, 30, "the job moved to w2")
        assert turn_queue.queued(redis_client, POOL, None) == 0
        assert turn_queue.parse_turn_job(redis_client.get(keys.turn_job("t1"))) == ("turns-1", "w2")
        assert redis_client.llen(keys.serve_inbox(SERVER)) == 0  # not failed, not run here

    _serve(redis_client, worker, driver)


def test_a_turn_in_the_pools_shared_lane_is_answered_by_a_worker_with_no_rq_record(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)

    def driver() -> None:
        push(redis_client, None, turn_job("turns-1", "t1"))
        rows = rows_from_ipc(_reply(redis_client, "t1")).to_pylist()
        assert [(r["session_id"], r["worker_id"]) for r in rows] == [("s-t1", "w1")]

    _serve(redis_client, worker, driver)
    assert turn_queue.queued(redis_client, POOL, None) == 0
    assert not redis_client.keys("rq:*turns-1*")


def test_a_failing_turn_is_retried_once_then_its_server_gets_the_error(redis_client: redis.Redis) -> None:
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)
    request = RolloutRequest.model_validate({"id": "s:0", "input_ids": [1, 2]})
    # Its prompt ids live beside the job in Redis, and are gone: the job fails each time it runs.
    payload, _ = JobPayload.pack_beside([request], prompt_key=keys.prompts("lane-1"), run="r", job_id="lane-1",
                                        batch_id="lane-1", output="file:///tmp/out", submitted_at_ms=0,
                                        turns=[TurnTag(turn_id="t1", session_id="s", turn=0, reply_to=SERVER)])

    def driver() -> None:
        push(redis_client, "w1", turn_queue.new_job("lane-1", payload.as_json(), {}, "1 turn", timeout_s=60,
                                                    retries=1))
        failure = TurnFailure.decode(_reply(redis_client, "t1"))
        assert failure is not None and failure.code == "failed" and "gone from Redis" in failure.reason

    _serve(redis_client, worker, driver)
    outcomes = {outcome: worker.metrics.registry.get_sample_value(
        "pipeline_worker_jobs_total", {"worker": "w1", "engine": "fake", "outcome": outcome}) for outcome in
        ("retried", "failed")}
    assert outcomes == {"retried": 1, "failed": 1}
    assert turn_queue.queued(redis_client, POOL, "w1") == 0


def test_a_paused_pools_worker_takes_no_turn_until_resumed(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    client.pause()
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1", control_poll_s=0.1)

    def driver() -> None:
        push(redis_client, "w1", turn_job("lane-1", "t1"))
        assert redis_client.blpop([keys.serve_inbox(SERVER)], timeout=1.5) is None  # paused: not taken
        assert turn_queue.queued(redis_client, POOL, "w1") == 1
        client.resume()
        rows_from_ipc(_reply(redis_client, "t1"))

    _serve(redis_client, worker, driver)


def test_a_quiet_queue_blocks_within_the_connections_read_timeout(redis_url: str) -> None:
    """RQ gives the worker's connections a read timeout (11 s with a 1 s maintenance interval): a read
    of a quiet queue blocks for half of it at most, so a busy worker's late read is no TimeoutError."""
    conn = redis.Redis.from_url(redis_url)
    worker = RolloutWorker(conn, FakeEngine(), worker_id="w1", maintenance_interval_s=1)
    reader = worker.turn_reader
    reader.take_over_s = reader.block_s = 60.0
    reader._next_take_over = time.monotonic() + 60
    read_timeout = conn.connection_pool.connection_kwargs["socket_timeout"]
    assert reader._block_s() == pytest.approx(read_timeout / 2)


def test_a_read_blocks_within_its_own_connections_timeout_not_its_pools(redis_url: str) -> None:
    """A client made with a 5 s read timeout whose pool already holds a connection: RQ raises the pool's
    timeout for connections made later, but the reader may read on the earlier one. Its reads block
    for half of that connection's timeout (they blocked up to 5 s there and failed now and then)."""
    conn = redis.Redis.from_url(redis_url, socket_timeout=5)
    conn.ping()  # a connection with the 5 s timeout, back in the pool for the reader to take
    worker = RolloutWorker(conn, FakeEngine(), worker_id="w1")
    reader = worker.turn_reader
    assert conn.connection_pool.connection_kwargs["socket_timeout"] > 5  # RQ raised the pool's
    assert reader._reader.connection.socket_timeout == 5
    reader.take_over_s = reader.block_s = 60.0
    reader._next_take_over = time.monotonic() + 60
    assert reader._block_s() == pytest.approx(2.5)


def test_an_entry_read_as_the_reply_was_lost_is_taken_back_by_its_worker(redis_client: redis.Redis) -> None:
    """A read whose reply never came (a read timeout, a dropped connection) after Redis handed the
    entry to the worker: it is pending, held by no job; the worker takes it over once it is idle."""
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1")
    turn_queue.register(redis_client, POOL, "w1")
    push(redis_client, "w1", turn_job("lane-1", "t1"))
    TURNS.read_new(redis_client, [POOL.turn_queue("w1")], "w1", 1, None)  # handed out; its reply "lost"
    reader = worker.turn_reader
    reader.claim_after_s = 60
    assert reader.take_over() == []  # not idle long enough: it may be in flight
    reader.claim_after_s, reader._next_own_claim = 0, 0.0
    [back] = reader.take_over()
    assert back.job.job_id == "lane-1"


def test_a_lane_entry_a_dead_worker_held_is_taken_over_by_a_live_one(redis_client: redis.Redis) -> None:
    alive(redis_client, "w1")
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1")
    turn_queue.register(redis_client, POOL, "w1")
    push(redis_client, None, turn_job("held", "t1"))
    TURNS.read_new(redis_client, [POOL.lane], "dead", 1, None)  # read by a worker that died with it
    reader = worker.turn_reader
    reader.claim_after_s = 60
    assert reader.take_over() == []  # its holder may be alive and running it
    reader.claim_after_s, reader._next_own_claim = 0, 0.0
    [taken] = reader.take_over()
    assert (taken.stream, taken.job.job_id) == (POOL.lane, "held")


def test_a_dead_workers_turns_are_taken_over_by_a_live_one(redis_client: redis.Redis) -> None:
    """A dead worker's stream: the entry it held and the one no worker had are both taken, at once,
    by the live worker's next take-over; the stream is forgotten once they are done."""
    alive(redis_client, "w1")
    worker = RolloutWorker(redis_client, FakeEngine(), worker_id="w1")
    turn_queue.register(redis_client, POOL, "dead")
    push(redis_client, "dead", turn_job("held", "t1"))
    push(redis_client, "dead", turn_job("queued", "t2"))
    TURNS.read_new(redis_client, [POOL.turn_queue("dead")], "dead", 1, None)  # the dead worker had one
    time.sleep(1.1)  # the take-over leaves an entry claimed within the last second to its taker

    def driver() -> None:
        answered = answers(redis_client, 2)
        assert sorted(answered) == ["t1", "t2"]
        wait_until(lambda: not redis_client.exists(POOL.turn_queue("dead")), 30, "the dead queue forgotten")

    _serve(redis_client, worker, driver)
    assert redis_client.smembers(POOL.turn_queue_owners) == {b"w1"}
