"""Scheduled retries: every worker's maintenance thread enqueues due ones, exactly once.

Single process, Redis semantics only: fakeredis. (Retries across real worker processes are in
tests/test_faults.py.)
"""

from __future__ import annotations

from datetime import timedelta

import fakeredis
import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from workers.jobs.maintenance import RegistryMaintenance

FUNCTION = "workers.jobs.batch_job.run_rollout_batch"


@pytest.fixture
def queue() -> Queue:
    return Queue("rollouts", connection=fakeredis.FakeRedis(), serializer=JSONSerializer)


def maintenance(queue: Queue) -> RegistryMaintenance:
    return RegistryMaintenance(queue.connection, [queue], interval_s=1, exception_handlers=[],
                               fail_job=lambda job, q, reason: None)


def test_due_retries_are_enqueued_once_and_later_ones_wait(queue: Queue) -> None:
    due = queue.enqueue_in(timedelta(seconds=-1), FUNCTION, {"n": 1})
    later = queue.enqueue_in(timedelta(hours=1), FUNCTION, {"n": 2})
    first, second = maintenance(queue), maintenance(queue)  # two workers of the same pool
    assert first.next_retry_in() == 0.0  # one is due now
    first.enqueue_due_retries()
    second.enqueue_due_retries()
    assert queue.get_job_ids() == [due.id]
    assert queue.scheduled_job_registry.get_job_ids() == [later.id]
    assert 3500 < first.next_retry_in() <= 3600


def test_a_worker_enqueuing_retries_keeps_the_others_out(queue: Queue) -> None:
    due = queue.enqueue_in(timedelta(seconds=-1), FUNCTION, {"n": 1})
    lock = f"{queue.scheduled_job_registry.key}:enqueuing"
    queue.connection.set(lock, 1)  # another worker is at it
    maintenance(queue).enqueue_due_retries()
    assert queue.count == 0 and queue.scheduled_job_registry.get_job_ids() == [due.id]
    queue.connection.delete(lock)
    maintenance(queue).enqueue_due_retries()
    assert queue.get_job_ids() == [due.id] and queue.scheduled_job_registry.get_job_ids() == []


def test_no_scheduled_retry_means_nothing_to_wait_for(queue: Queue) -> None:
    assert maintenance(queue).next_retry_in() is None


def test_a_due_retry_of_a_job_that_ended_meanwhile_is_not_run_again(queue: Queue) -> None:
    job = queue.enqueue_in(timedelta(seconds=-1), FUNCTION, {"n": 1})
    job.set_status("finished")  # its worker ran it to the end after RQ took it for abandoned
    maintenance(queue).enqueue_due_retries()
    assert queue.count == 0 and queue.scheduled_job_registry.get_job_ids() == []


def test_the_check_says_when_the_next_retry_is_due_so_an_idle_worker_looks_less_often(queue: Queue) -> None:
    """None when nothing is scheduled (the thread then looks every RETRY_IDLE_CHECK_S), the seconds
    to the earliest retry otherwise, 0 when one was just enqueued (look again soon)."""
    assert maintenance(queue).enqueue_due_retries() is None
    queue.enqueue_in(timedelta(hours=1), FUNCTION, {"n": 1})
    assert 3500 < (maintenance(queue).enqueue_due_retries() or 0) <= 3600
    queue.enqueue_in(timedelta(seconds=-1), FUNCTION, {"n": 2})
    assert maintenance(queue).enqueue_due_retries() == 0.0 and queue.count == 1


def test_a_pools_periodic_cleanup_runs_once_an_interval_whichever_worker_claims_it(queue: Queue) -> None:
    """Every idle worker of a pool used to clean all of its registries every interval: the Redis load
    of an idle fleet grew with its size. The first worker to come round claims the round; an
    on-demand `clean` still runs."""
    cleaned: list[str] = []

    class Counting(RegistryMaintenance):
        def clean(self) -> None:
            cleaned.append("clean")

    first = Counting(queue.connection, [queue], interval_s=60, exception_handlers=[], fail_job=lambda *a: None)
    second = Counting(queue.connection, [queue], interval_s=60, exception_handlers=[], fail_job=lambda *a: None)
    assert first.periodic_clean() is True
    assert second.periodic_clean() is False and first.periodic_clean() is False
    assert cleaned == ["clean"]
    second.clean()
    assert cleaned == ["clean", "clean"]
    queue.connection.delete(f"{queue.registry_cleaning_key}:swept")  # the interval is over
    assert second.periodic_clean() is True
