"""Jobs a Redis failover orphaned are requeued: each test makes, on a real redis-server, the state a
write lost with a dead master leaves (a job `started` in no queue and no registry; a job `queued`
whose queue entry vanished; a job `finished` whose commit vanished) and checks that the sweep
requeues exactly those, and that a real worker then runs them to the end."""

from __future__ import annotations

import time
from pathlib import Path

import redis
from rq.job import Job

from pipeline.core.broker import commit_log, keys
from pipeline.core.broker.commit_log import Commit
from pipeline.core.jobs.queue import rollout_queue
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from workers.jobs.maintenance import RegistryMaintenance
from workers.jobs.reconcile import Reconciler

POOL = keys.pool(None)


def _submit(conn: redis.Redis, tmp_path: Path, jobs: int, run: str = "orphans") -> Batch:
    requests = [RolloutRequest(id=f"r{i}", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
                for i in range(jobs)]
    return Batch(conn, submit_requests(conn, requests, run=run, output=f"file://{tmp_path}/shards", batch_size=1))


def _reconciler(conn: redis.Redis, grace_s: float = 0.0) -> Reconciler:
    return Reconciler(conn, [rollout_queue(conn)], POOL.name, grace_s=grace_s, interval_s=1)


def _orphan_started(conn: redis.Redis, job_id: str) -> None:
    """What a lost write leaves: the job's hash says started (a worker took it), but the dequeue, the
    started-registry entry and the end never reached the promoted replica, or only some of them did."""
    queue = rollout_queue(conn)
    conn.lrem(queue.key, 0, job_id)
    conn.hset(Job.key_for(job_id), mapping={"status": "started", "worker_name": "gone-worker"})


def _where(conn: redis.Redis, job_id: str) -> tuple[str, bool]:
    queue = rollout_queue(conn)
    status = conn.hget(Job.key_for(job_id), "status")
    return (status.decode() if status else "missing"), job_id.encode() in conn.lrange(queue.key, 0, -1)


def test_a_started_job_held_nowhere_is_requeued_and_nothing_else_is(redis_client: redis.Redis, tmp_path: Path) -> None:
    batch = _submit(redis_client, tmp_path, 4)
    orphan, running, queued, lost_enqueue = batch.job_ids
    _orphan_started(redis_client, orphan)
    # A job a live worker runs: started, out of the queue, with a live started-registry entry.
    queue = rollout_queue(redis_client)
    redis_client.lrem(queue.key, 0, running)
    redis_client.hset(Job.key_for(running), "status", "started")
    redis_client.zadd(queue.started_job_registry.key, {f"{running}:exec1": time.time() + 60})
    # A job whose queue entry a lost write took (a hand-back that never reached the replica).
    redis_client.lrem(queue.key, 0, lost_enqueue)

    sweeper = _reconciler(redis_client)
    assert sweeper.sweep() == []  # seen orphaned once: not yet
    assert sorted(sweeper.sweep()) == sorted([orphan, lost_enqueue])  # seen again, grace passed (0 s)
    assert _where(redis_client, orphan) == ("queued", True)
    assert _where(redis_client, lost_enqueue) == ("queued", True)
    assert _where(redis_client, running) == ("started", False)  # held by its execution: untouched
    assert _where(redis_client, queued) == ("queued", True)
    assert redis_client.lrange(queue.key, 0, -1).count(queued.encode()) == 1  # nothing queued twice
    assert sweeper.sweep() == []  # nothing orphaned is left


def test_the_grace_period_protects_a_job_between_two_places(redis_client: redis.Redis, tmp_path: Path) -> None:
    """A job seen orphaned once is left alone until `grace_s` has passed (a live worker re-adds a lost
    started-registry entry at its next heartbeat), and is not requeued if it turns up meanwhile."""
    batch = _submit(redis_client, tmp_path, 1)
    (job_id,) = batch.job_ids
    _orphan_started(redis_client, job_id)
    patient = _reconciler(redis_client, grace_s=3600)
    assert patient.sweep() == [] and patient.sweep() == []
    assert _where(redis_client, job_id) == ("started", False)
    # Its worker's heartbeat puts the entry back: no longer orphaned, even once the grace is over.
    queue = rollout_queue(redis_client)
    redis_client.zadd(queue.started_job_registry.key, {f"{job_id}:exec1": time.time() + 60})
    eager = _reconciler(redis_client)
    assert eager.sweep() == [] and eager.sweep() == []
    assert _where(redis_client, job_id) == ("started", False)


def test_a_finished_job_whose_commit_was_lost_runs_again(redis_client: redis.Redis, tmp_path: Path) -> None:
    batch = _submit(redis_client, tmp_path, 2)
    lost, kept = batch.job_ids
    queue = rollout_queue(redis_client)
    for job_id in batch.job_ids:
        redis_client.lrem(queue.key, 0, job_id)
        redis_client.hset(Job.key_for(job_id), "status", "finished")
    commit_log.append(redis_client, "orphans", Commit(kept, batch.plan.batch_id, "file:///kept.parquet", 1, 2, 0))
    sweeper = _reconciler(redis_client)
    sweeper.sweep()
    assert sweeper.sweep() == [lost]
    assert _where(redis_client, lost) == ("queued", True)
    assert _where(redis_client, kept) == ("finished", False)


def test_a_batch_leaves_the_open_set_once_every_job_ended(redis_client: redis.Redis, tmp_path: Path) -> None:
    batch = _submit(redis_client, tmp_path, 1)
    (job_id,) = batch.job_ids
    assert redis_client.sismember(POOL.open_batches, batch.plan.batch_id)  # the submit opened it
    sweeper = _reconciler(redis_client)
    sweeper.sweep()
    assert redis_client.sismember(POOL.open_batches, batch.plan.batch_id)  # its job is queued
    redis_client.lrem(rollout_queue(redis_client).key, 0, job_id)
    redis_client.hset(Job.key_for(job_id), "status", "failed")
    sweeper.sweep()  # ended once: kept a grace period longer (a failover could still undo the end)
    assert redis_client.sismember(POOL.open_batches, batch.plan.batch_id)
    sweeper.sweep()
    assert not redis_client.sismember(POOL.open_batches, batch.plan.batch_id)


def test_a_worker_runs_an_orphaned_job_to_the_end(
    redis_client: redis.Redis, tmp_path: Path, start_worker
) -> None:
    """The gap of issue 18, deterministically: a job whose state a failover orphaned (started, in no
    queue and no registry) kept its batch from ever finishing. A real worker process now requeues
    it within its maintenance and runs it; every request has its row."""
    batch = _submit(redis_client, tmp_path, 3)
    _orphan_started(redis_client, batch.job_ids[1])
    start_worker("--engine", "sim", "--sim-step-ms", "1", "--sim-median-tokens", "2", "--sim-p99-tokens", "3",
                 "--maintenance-interval", "1", "--stuck-after", "1", "--heartbeat-interval", "0.5")
    batch.wait(timeout=60)
    rows = batch.read(columns=["request_id"]).column("request_id").to_pylist()
    assert sorted(rows) == ["r0", "r1", "r2"]


def test_a_retry_scheduled_for_a_job_that_ended_since_is_dropped(redis_client: redis.Redis, tmp_path: Path) -> None:
    """RQ took the job for abandoned (its started entry outlived a lost end) and scheduled a retry,
    while its worker ran it to the end: the retry is dropped, not run a second time."""
    batch = _submit(redis_client, tmp_path, 2)
    ended, waiting = batch.job_ids
    queue = rollout_queue(redis_client)
    for job_id in batch.job_ids:
        redis_client.lrem(queue.key, 0, job_id)
        redis_client.zadd(queue.scheduled_job_registry.key, {job_id: time.time() + 60})
    redis_client.hset(Job.key_for(waiting), "status", "scheduled")
    redis_client.hset(Job.key_for(ended), "status", "failed")
    assert _reconciler(redis_client).sweep() == []
    assert [m.decode() for m in redis_client.zrange(queue.scheduled_job_registry.key, 0, -1)] == [waiting]


def _maintenance(conn: redis.Redis, grace_s: float) -> RegistryMaintenance:
    queue = rollout_queue(conn)
    return RegistryMaintenance(conn, [queue], interval_s=1, exception_handlers=[], stuck_after_s=grace_s,
                               fail_job=lambda job, q, reason: None, reconcilers=[_reconciler(conn, grace_s)])


def test_no_job_is_taken_for_abandoned_while_the_new_master_settles(redis_client: redis.Redis, tmp_path: Path) -> None:
    """No heartbeat reaches any master during a failover, so the started entries of jobs that live
    workers still run have expired when the new master answers. For a grace period after the master
    changed, maintenance takes none of them for abandoned (their next heartbeats refresh them)."""
    batch = _submit(redis_client, tmp_path, 1)
    (job_id,) = batch.job_ids
    queue = rollout_queue(redis_client)
    redis_client.lrem(queue.key, 0, job_id)
    redis_client.hset(Job.key_for(job_id), "status", "started")
    patient = _maintenance(redis_client, grace_s=3600)
    patient.clean()  # the master as the worker first sees it: nothing changed yet
    redis_client.execute_command("DEBUG", "CHANGE-REPL-ID")  # what a promotion does to the replication id
    redis_client.zadd(queue.started_job_registry.key, {f"{job_id}:exec1": time.time() - 1})  # expired
    patient.clean()
    assert _where(redis_client, job_id) == ("started", False)
    assert redis_client.zcard(queue.started_job_registry.key) == 1  # left for its worker's next heartbeat
    eager = _maintenance(redis_client, grace_s=0)
    eager.clean()  # without a change seen (or once the grace is over): abandoned, retried
    assert _where(redis_client, job_id)[0] == "scheduled"
