"""A burst worker runs the retries it scheduled, whichever thread moves them to the queue.

Single process, real Redis: the race is forced, not waited for.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from workers.engines.fake import FakeEngine
from workers.process.engine_worker import EngineWorker
from workers.process.worker import RolloutWorker


def test_a_retry_the_maintenance_thread_enqueues_after_an_empty_dequeue_still_runs(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job waits out its backoff in the scheduled registry; the worker's dequeue finds the queue
    empty, and only then does the maintenance thread move the (now due) retry to the queue. The
    registry is empty by the time the worker looks there: it must look at the queue again rather
    than exit and leave the job queued with no worker (tests/test_faults.py failed so under load)."""
    requests = [RolloutRequest(id="r0", input_ids=[1, 2], sampling_params={"max_new_tokens": 2})]
    batch = Batch(redis_client, submit_requests(redis_client, requests, run="retry", output=f"file://{tmp_path}"))
    queue = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    [job_id] = batch.job_ids
    queue.remove(job_id)
    queue.schedule_job(Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer),
                       datetime.now(UTC) - timedelta(seconds=1))  # a retry whose backoff has passed
    lock = f"{queue.scheduled_job_registry.key}:enqueuing"
    redis_client.set(lock, 1)  # the maintenance thread holds off until the race below
    original = EngineWorker.dequeue_job_and_maintain_ttl
    raced: list[bool] = []

    def dequeue_then_race(self: RolloutWorker, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if result is None and not raced:  # right after the empty dequeue, the thread moves the retry
            raced.append(True)
            redis_client.delete(lock)
            self.maintenance.enqueue_due_retries()
            assert queue.get_job_ids() == [job_id] and self.maintenance.next_retry_in() is None
        return result

    monkeypatch.setattr(EngineWorker, "dequeue_job_and_maintain_ttl", dequeue_then_race)
    engine = FakeEngine()
    RolloutWorker(redis_client, engine, maintenance_interval_s=1).work(burst=True, with_scheduler=False,
                                                                       logging_level="ERROR")
    assert raced and len(engine.calls) == 1
    assert batch.wait(timeout=5).counts["finished"] == 1 and batch.read().num_rows == 1
