"""`Batch.wait` blocks on Redis and wakes when a job finishes or fails, not on a polling clock.

Each test waits with a re-check interval far beyond its timeout: a wait that did not wake on
the job's end would raise `WaitTimeoutError` instead of returning.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job

import pipeline
from pipeline.core.broker import keys
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from tests.helpers.processes import wait_until
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker

NEVER = 3600.0  # re-check interval: only a wake-up from Redis ends these waits in time


def wait_in_thread(batch: Batch, outcome: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            outcome["status"] = batch.wait(timeout=20, poll_s=NEVER, progress=False)
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def blocked_in_xread(conn: redis.Redis) -> bool:
    return any(client.get("cmd") == "xread" and "b" in client.get("flags", "") for client in conn.client_list())


@pytest.mark.parametrize("request_id,expected", [("a", "finished"), ("boom", "failed")])
def test_wait_wakes_when_the_job_ends(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path, request_id: str, expected: str,
) -> None:
    trainer = redis.Redis.from_url(redis_url)  # its own client, no read timeout (RQ sets one on the worker's)
    request = RolloutRequest.model_validate({"id": request_id, "input_ids": [1]})
    batch = Batch(trainer, submit_requests(trainer, [request], run="wake", output=f"file://{tmp_path}", retries=0))
    outcome: dict[str, Any] = {}
    waiter = wait_in_thread(batch, outcome)
    wait_until(lambda: blocked_in_xread(redis_client), 10, "the wait to block in XREAD")
    worker = RolloutWorker(redis_client, FakeEngine(fail_ids={"boom"}))
    worker.work(burst=True, with_scheduler=False, logging_level="ERROR")
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    if expected == "finished":
        assert "error" not in outcome and outcome["status"].counts["finished"] == 1
    else:
        assert isinstance(outcome.get("error"), pipeline.JobsFailedError), outcome
        assert "fail_ids" in str(outcome["error"])


def test_wait_never_blocks_past_the_clients_read_timeout(redis_url: str, tmp_path: Path) -> None:
    # A client with a 1 s read timeout: blocking reads are cut to fit, so the wait times out as a
    # wait (WaitTimeoutError), not as a dropped connection (redis.TimeoutError).
    conn = redis.Redis.from_url(redis_url, socket_timeout=1.0)
    request = RolloutRequest.model_validate({"id": "a", "input_ids": [1]})
    batch = Batch(conn, submit_requests(conn, [request], run="slow", output=f"file://{tmp_path}"))
    with pytest.raises(pipeline.WaitTimeoutError, match="0/1 jobs done"):
        batch.wait(timeout=2.5, poll_s=NEVER, progress=False)  # no worker


def test_read_before_the_batch_is_complete_raises_unless_partial(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit([{"id": "a", "input_ids": [1, 2]}, {"id": "b", "input_ids": [3]}], run="early",
                          output=f"file://{tmp_path}", batch_size=1)
    with pytest.raises(pipeline.IncompleteBatchError, match=r"run 'early' is not complete: 0 of 2 job\(s\) ended "
                       r"\(0 committed\); `wait\(\)` first, or `read\(partial=True\)`"):
        batch.read()
    assert batch.read(partial=True).num_rows == 0
    RolloutWorker(redis_client, FakeEngine(), control_poll_s=0.2).work(burst=True, with_scheduler=False,
                                                                       logging_level="WARNING")
    assert batch.read().num_rows == 2


def test_a_wait_that_runs_out_says_the_pool_is_paused_or_has_no_worker(
    redis_client: redis.Redis, tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit([{"id": "a", "input_ids": [1, 2]}], run="held", output=f"file://{tmp_path}")
    with pytest.raises(pipeline.WaitTimeoutError, match="no worker is live in pool 'default'"):
        batch.wait(timeout=0.2, progress=False)
    client.pause()
    paused = "pool 'default' is paused: its workers take no job until `pipeline resume --pool default`"
    with pytest.raises(pipeline.WaitTimeoutError, match=paused):
        batch.wait(timeout=0.2, progress=False)
    with pytest.raises(pipeline.WaitTimeoutError, match=paused):
        list(client.follow("held", timeout=0.2))


def test_wait_on_a_batch_a_failover_lost_raises_instead_of_waiting_forever(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The master that took a submit died after the submit returned, and the promoted replica never had
    it: the batch's record and its jobs are gone together (one transaction). `wait` says so."""
    plan = submit_requests(redis_client, [RolloutRequest(id="r0", input_ids=[1, 2])], run="lost",
                           output=f"file://{tmp_path}/shards")
    redis_client.delete(keys.batch(plan.batch_id), *(Job.key_for(job_id) for job_id in plan.job_ids))
    with pytest.raises(pipeline.SubmitLostError, match=f"batch {plan.batch_id} of run 'lost' was enqueued on a "
                       "Redis master that failed over"):
        Batch(redis_client, plan).wait(timeout=30)


def test_a_batch_shows_what_was_submitted_and_where_its_rows_go(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client, pool="tour")
    batch = client.submit([{"id": f"q{i}", "input_ids": [1, 2], "sampling_params": {"n": 2}} for i in range(3)],
                          run="tour-2", output=f"file://{tmp_path}", batch_size=2, reward="exact_match")
    assert repr(batch) == (f"Batch(run='tour-2', pool='tour', jobs=2, requests=3, samples=6, "
                           f"url='file://{tmp_path}/tour-2', reward='exact_match')")
