"""Forgetting a run or a pool: delete their state in Redis (`pipeline runs delete`, `pipeline pools delete`).

A run's state is its batches, job records, staged prompt ids, commit log and totals, canceled set,
rewards streams and agent-turn logs; its shards stay where they were written unless the caller
removes them (`delete_run(..., shards=True)`). A pool's state is its desired state (weights,
paused) and weight acknowledgements, its queues and RQ registries, its worker registry and the
runs submitted to it. Nothing is deleted while work is in flight: a run with a queued or running
job, or a pool with a live worker, is refused with what to do first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys, registry
from pipeline.core.errors import PipelineError, UnknownRunError
from pipeline.core.jobs.status import read_status
from pipeline.core.suggest import did_you_mean, listing

# RQ states of a job that may still run (a run holding one is not deleted).
_IN_FLIGHT = {b"queued", b"started", b"scheduled", b"deferred"}


@dataclass
class DeletedRun:
    """What `delete_run` removed: the run's jobs and committed rows, and where its shards are."""

    run: str
    jobs: int
    rows: int
    outputs: list[str] = field(default_factory=list)  # the run's shard directories (`output/run`)
    shards_removed: bool = False


@dataclass
class DeletedPool:
    """What `delete_pool` removed: the desired weights it held and its runs (those of no other pool)."""

    pool: str
    weight_version: int
    weight_path: str | None
    runs: list[DeletedRun] = field(default_factory=list)


def run_batches(conn: redis.Redis, run: str) -> dict[str, dict[str, str]]:
    """The run's batches: batch id → its record (run, output, pool, job_ids, submitted_at_ms, ...)."""
    ids = sorted(m.decode() for m in conn.smembers(keys.run_batches(run)))
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))
        records = pipe.execute() if ids else []
    return {batch_id: {k.decode(): v.decode() for k, v in record.items()}
            for batch_id, record in zip(ids, records, strict=True)}


def _job_ids(batches: dict[str, dict[str, str]]) -> list[str]:
    return [job for record in batches.values() for job in record.get("job_ids", "").split(",") if job]


def _unknown_run(conn: redis.Redis, run: str) -> UnknownRunError:
    known = registry.runs(conn)
    return UnknownRunError(f"no run {run!r} in this Redis; runs here: {listing(known)}{did_you_mean(run, known)}")


def _refuse_busy(conn: redis.Redis, run: str, job_ids: list[str]) -> None:
    """`PipelineError` when a job of the run is queued or running."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            read_status(pipe, job_id)
        states = pipe.execute() if job_ids else []
    busy = sum(1 for state in states if state in _IN_FLIGHT)
    if busy:
        raise PipelineError(f"run {run!r} has {busy} job(s) queued or running; cancel them first "
                            f"(`pipeline cancel --run {run}`) or wait for them to end; nothing was deleted")


def delete_run(conn: redis.Redis, run: str, *, shards: bool = False) -> DeletedRun:
    """Delete every Redis key of `run`; with `shards`, its shard directories too.

    Raises `UnknownRunError` ("did you mean") for a run this Redis does not know, and
    `PipelineError` when a job of the run is still queued or running (cancel it first)."""
    pools = [name for name in registry.pools(conn) if conn.sismember(keys.pool(name).runs, run)]
    batches = run_batches(conn, run)
    if not pools and not batches and not conn.exists(keys.commit_log(run)):
        raise _unknown_run(conn, run)
    job_ids = _job_ids(batches)
    _refuse_busy(conn, run, job_ids)
    rows = int(conn.hget(keys.run_totals(run), "rows") or 0)
    outputs = sorted({f"{record['output']}/{run}" for record in batches.values() if record.get("output")})
    for job_id in job_ids:
        try:
            Job.fetch(job_id, connection=conn, serializer=JSONSerializer).delete()
        except NoSuchJobError:  # an expired record: its keys are gone already
            continue
    with conn.pipeline(transaction=True) as pipe:
        pipe.delete(*[keys.prompts(job_id) for job_id in job_ids] or ["-"])
        pipe.delete(*[keys.batch(batch_id) for batch_id in batches] or ["-"])
        for name in registry.pools(conn):
            pipe.srem(keys.pool(name).runs, run)
            if batches:
                pipe.srem(keys.pool(name).open_batches, *batches)
        pipe.srem(keys.REWARD_RUNS, run)
        pipe.srem(keys.TURN_RUNS, run)
        pipe.delete(keys.commit_log(run), keys.run_jobs(run), keys.run_totals(run), keys.run_batches(run),
                    keys.canceled(run), keys.run_request_ids(run), keys.reward_log(run), keys.reward_jobs(run),
                    keys.reward_totals(run), keys.turn_log(run), keys.turn_log_jobs(run), keys.turn_log_output(run),
                    keys.turn_flush_lock(run), keys.run_turn_stats(run))
        pipe.execute()
    deleted = DeletedRun(run, len(job_ids), rows, outputs)
    if shards:
        from pipeline.core.storage import url_to_fs

        for url in outputs:
            fs, path = url_to_fs(url)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        deleted.shards_removed = True
    return deleted


def reset_control(conn: redis.Redis, pool: str) -> None:
    """Forget the pool's desired state (weights, paused) and weight acknowledgements: its workers
    start on the weights they load themselves, at version 0, running. Refused (`PipelineError`)
    while a worker of the pool is live: it would keep serving weights the pool no longer names."""
    where = keys.pool(pool)
    live = registry.live_workers(conn, where.name)
    if live:
        raise PipelineError(f"pool {where.name!r} is served by {len(live)} live worker(s) "
                            f"({listing(w.worker_id for w in live)}); stop them, or use another pool, to start it "
                            "afresh; nothing was reset")
    acks = list(conn.scan_iter(match=where.weight_acks(0)[: -len("0")] + "*", count=1000))
    conn.delete(where.control_state, *acks)


def delete_pool(conn: redis.Redis, pool: str) -> DeletedPool:
    """Delete the pool: its runs (`delete_run`, shards kept; a run also submitted to another pool stays
    there), queues, RQ registries, desired state and acknowledgements, worker registry. Refused, with
    nothing deleted, while a worker of the pool is live or a job of its runs is queued or running,
    and for a pool this Redis never named."""
    from pipeline.core.broker.control_channel import read_state

    where = keys.pool(pool)
    if where.name not in registry.pools(conn):
        known = registry.pools(conn)
        raise PipelineError(f"no pool {where.name!r} in this Redis; pools here: {listing(known)}"
                            f"{did_you_mean(where.name, known)}")
    live = registry.live_workers(conn, where.name)
    if live:
        raise PipelineError(f"pool {where.name!r} has {len(live)} live worker(s) "
                            f"({listing(w.worker_id for w in live)}); stop them first; nothing was deleted")
    state = read_state(conn, where.name)
    others = [keys.pool(name).runs for name in registry.pools(conn) if name != where.name]
    runs = [run for run in sorted(m.decode() for m in conn.smembers(where.runs))
            if not any(conn.sismember(other, run) for other in others)]
    for run in runs:
        _refuse_busy(conn, run, _job_ids(run_batches(conn, run)))
    queues = [Queue(where.queue_name, connection=conn, serializer=JSONSerializer)]
    waiting = sum(queue.count + queue.started_job_registry.get_job_count(cleanup=False) for queue in queues)
    waiting += conn.xlen(where.lane)  # jobs of agent turns no worker has finished
    if waiting:
        raise PipelineError(f"pool {where.name!r} has {waiting} job(s) queued or running; cancel their runs "
                            "first (`pipeline cancel --run NAME`); nothing was deleted")
    deleted = DeletedPool(where.name, state.weight_version, state.weight_path)
    for run in runs:
        deleted.runs.append(delete_run(conn, run))
    for queue in queues:
        registries = [queue.started_job_registry, queue.failed_job_registry, queue.finished_job_registry,
                      queue.deferred_job_registry, queue.scheduled_job_registry, queue.canceled_job_registry]
        queue.delete(delete_jobs=True)
        conn.delete(*[r.key for r in registries])
    reset_control(conn, where.name)
    conn.delete(where.workers, where.runs, where.open_batches, where.unservable, where.open_sessions, where.lane)
    if where.name != keys.DEFAULT_POOL:  # every other key under the pool's own prefix (the default's is shared)
        leftovers = list(conn.scan_iter(match=f"{keys.PREFIX}:pool:{where.name}:*", count=1000))
        if leftovers:
            conn.delete(*leftovers)
    conn.srem(keys.POOLS, where.name)
    return deleted
