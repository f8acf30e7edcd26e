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

import pipeline
from pipeline.batch import Batch
from pipeline.submit import submit_requests
from schemas.request import RolloutRequest
from tests.helpers import wait_until
from workers.engines.fake import FakeEngine
from workers.worker import RolloutWorker

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


@pytest.mark.parametrize("logprobs,expected", [(None, "finished"), (3, "failed")])
def test_wait_wakes_when_the_job_ends(
    redis_client: redis.Redis, tmp_path: Path, logprobs: int | None, expected: str,
) -> None:
    request = RolloutRequest.model_validate({"id": "a", "input_ids": [1], "logprobs": logprobs})
    batch = Batch(redis_client, submit_requests(redis_client, [request], run="wake", output=f"file://{tmp_path}",
                                                retries=0))
    outcome: dict[str, Any] = {}
    waiter = wait_in_thread(batch, outcome)
    wait_until(lambda: blocked_in_xread(redis_client), 10, "the wait to block in XREAD")
    # The worker (top-k 0) serves the plain request and fails the one asking for top-3 logprobs.
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="ERROR")
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    if expected == "finished":
        assert "error" not in outcome and outcome["status"].counts["finished"] == 1
    else:
        assert isinstance(outcome.get("error"), pipeline.JobsFailedError), outcome
        assert "top-3 logprobs" in str(outcome["error"])
