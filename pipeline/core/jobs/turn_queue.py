"""Workers' turn queues and the pool's shared lane: the jobs of agent turns, a Redis stream each, read
through the pool's workers' consumer group (`pipeline.core.broker.work_streams`, `TURNS`).

`pipeline serve` routes a session's turn to its home worker (`pipeline.core.affinity`) by adding a
`schemas.turn_job.TurnJob` to that worker's stream (`push`); a turn routed to no worker in
particular (no live worker can take it now, or `--no-affinity`) goes to the pool's shared lane
(`keys.PoolKeys.lane`), which every live worker reads beside its own. A worker reads as a consumer
of the group, admits what it can serve (a job it cannot serve is `move`d to a live worker that can,
or waits for one, `workers.process.turn_reader`), runs the job, and acknowledges the entry once its
turns are logged and answered (`done`), queues it again with one retry fewer (`retry`), hands it
back (`hand_back`: any worker takes it over at once) or fails its turns (`fail`: an error for each
turn in its server's inbox, and a failure mark the server reads, `turn_failure`). A turn so costs
an XADD, a read and an acknowledgement, instead of RQ's job lifecycle (hash, registries,
executions, results: ~60 commands a job).

A worker keeps the entries it runs fresh (`keep`). Once a worker is gone from the registry (killed,
its host away, or stopped), the live workers of the pool read its stream (`owners` says who is
dead): the entries it held are taken over at once (`WorkStreams.take_over_from`), and the entries
no worker had yet are read as from their own; the stream is forgotten once empty
(`forget_if_empty`). A worker's own entries left idle past `CLAIM_AFTER_S` (handed back, or read by
a reply that was lost) are taken over by the worker itself, and the lane's by any live worker
(those of a worker that died too). Nothing is moved on a failure: each entry stays where the server
put it, and the group's pending list says who runs it. An entry taken over while
its worker still ran it (a worker that looked dead in a partition) runs twice and answers once: the
turn log keeps the rows logged first (`workers.jobs.turn_commits`).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.client import Pipeline

from pipeline.core.broker import keys
from pipeline.core.broker.work_streams import Claimed, WorkStreams
from pipeline.core.jobs import replies
from schemas.turn_failure import TurnFailure
from schemas.turn_job import TurnJob

TURNS: WorkStreams[TurnJob] = WorkStreams(keys.TURN_GROUP, TurnJob.decode)
CLAIM_AFTER_S = 15.0  # a worker's own entry left idle this long (not in its hands) is taken over by it
KEEP_EVERY_S = 3.0  # how often a worker resets the idle time of the entries it runs
FAILED_TTL_S = 3600  # how long a failed turn's reason is kept for its server (`turn_failure`)


def new_job(job_id: str, payload: dict[str, Any], needs: dict[str, Any], description: str, *, timeout_s: int,
            retries: int) -> TurnJob:
    return TurnJob(job_id, payload, needs, description, timeout_s, retries, time.time())


def turn_job_value(job_id: str, worker: str | None) -> str:
    """What `keys.turn_job` holds for a turn in `worker`'s turn queue (None: the pool's shared lane)."""
    return f"{job_id}@{worker or ''}"


def parse_turn_job(value: bytes | None) -> tuple[str | None, str | None]:
    """(job id, the worker whose turn queue holds it: None for a job of the pool's shared lane)
    from `keys.turn_job`."""
    if value is None:
        return None, None
    job_id, _, worker = value.decode().partition("@")
    return job_id, worker or None


def stream_of(pool: keys.PoolKeys, worker: str | None) -> str:
    """`worker`'s turn queue, or the pool's shared lane for None."""
    return pool.lane if worker is None else pool.turn_queue(worker)


def push(pipe: Pipeline, pool: keys.PoolKeys, worker: str | None, job: TurnJob) -> None:
    """Queue `job` on `worker`'s turn queue (None: the pool's shared lane), then note where its turns
    are (in a pipeline).

    The entry first: a failover (replication is asynchronous) or a restart from the append-only file
    loses a suffix of the writes, so a turn whose job key survives has its entry too, and a waiter
    that finds no job key fails the turn at once (`pipeline.serve.turn_wait`: the client's retry
    runs it again) instead of waiting for an entry that is gone."""
    # The worker created its stream's group when it started (`register`); a stream made anew by this
    # XADD (its worker died and was forgotten since it was chosen) gets one from the turn's waiter.
    TURNS.add(pipe, stream_of(pool, worker), job.encode())
    for turn_id in job.turn_ids:
        pipe.set(keys.turn_job(turn_id), turn_job_value(job.job_id, worker), ex=2 * job.timeout_s)


def move(conn: redis.Redis, pool: keys.PoolKeys, claimed: Claimed[TurnJob], worker: str) -> None:
    """Hand a job its reader cannot serve to `worker`, one that can: its entry leaves where it was and
    joins `worker`'s turn queue, and its turns say so (one transaction: never in both, nor in none)."""
    with conn.pipeline(transaction=True) as pipe:
        TURNS.acknowledge(pipe, claimed)
        push(pipe, pool, worker, claimed.job)
        pipe.execute()


def register(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> None:
    """`worker_id`'s turn queue exists from now on, with its group (so its entries are read by the
    live workers once it is gone), and the pool's shared lane has its group too."""
    TURNS.ensure_group(conn, pool.turn_queue(worker_id))
    TURNS.ensure_group(conn, pool.lane)
    conn.sadd(pool.turn_queue_owners, worker_id)


def queued(conn: redis.Redis | Pipeline, pool: keys.PoolKeys, worker: str | None) -> Any:
    """How many entries `worker`'s turn queue (None: the shared lane) holds, waiting or running."""
    return conn.xlen(stream_of(pool, worker))


def done(conn: redis.Redis, claimed: Claimed[TurnJob]) -> None:
    """The job's turns are answered: its entry leaves the group's pending list and the stream (XACK and
    XDEL in one round trip, no MULTI: an entry acknowledged and left in the stream is never read again,
    and only keeps its stream from being forgotten)."""
    with conn.pipeline(transaction=False) as pipe:
        TURNS.acknowledge(pipe, claimed)
        pipe.execute()


def retry(conn: redis.Redis, claimed: Claimed[TurnJob]) -> None:
    """Queue a failed job again on the same stream, with one retry fewer (behind what waits)."""
    with conn.pipeline(transaction=True) as pipe:
        TURNS.acknowledge(pipe, claimed)
        TURNS.add(pipe, claimed.stream, claimed.job.retried().encode())
        pipe.execute()


def hand_back(conn: redis.Redis, worker_id: str, claimed: Claimed[TurnJob]) -> None:
    """Give a job back unrun, no retry spent (a shutdown, an engine failure, a pause): the next
    take-over of any live worker takes it."""
    with conn.pipeline(transaction=False) as pipe:
        TURNS.hand_back(pipe, worker_id, claimed)
        pipe.execute()


def keep(conn: redis.Redis, worker_id: str, held: list[Claimed[TurnJob]]) -> None:
    """Reset the idle time of the entries `worker_id` runs, so no other worker takes them over."""
    if held:
        TURNS.keep_claimed(conn, worker_id, held)


def fail(conn: redis.Redis, claimed: Claimed[TurnJob], failure: TurnFailure) -> None:
    """The job failed for good: each turn's server gets `failure` (in its inbox, and `turn_failure`)."""
    error = failure.encode()
    job = claimed.job
    with conn.pipeline(transaction=True) as pipe:
        TURNS.acknowledge(pipe, claimed)
        for turn_id in job.turn_ids:
            pipe.set(keys.turn_failed(turn_id), error, ex=FAILED_TTL_S)
        replies.push(pipe, ((turn["reply_to"], turn["turn_id"], error) for turn in job.payload.get("turns") or []))
        pipe.execute()


def turn_failure(conn: redis.Redis, turn_id: str) -> TurnFailure | None:
    """Why the turn's job failed for good, or None if it did not."""
    raw = conn.get(keys.turn_failed(turn_id))
    return None if raw is None else TurnFailure.decode(raw)


def owners(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> tuple[set[str], list[str]]:
    """(the live workers with a turn queue, `worker_id` included; the dead ones, sorted): two
    commands, whatever the pool's size (the registry's entries of the owners, not of every worker)."""
    others = sorted(m.decode() for m in conn.smembers(pool.turn_queue_owners) if m.decode() != worker_id)
    if not others:
        return {worker_id}, []
    entries = conn.mget([pool.worker(w) for w in others])
    dead = [w for w, entry in zip(others, entries, strict=True) if entry is None]
    return {worker_id, *(w for w, entry in zip(others, entries, strict=True) if entry is not None)}, dead


# KEYS: the stream, the pool's set of owners, the worker's load set. ARGV: the worker id. A dead
# worker's turn queue is forgotten once nothing is queued on it nor running from it.
_FORGET = """
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""


def forget_if_empty(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> bool:
    """Forget a dead worker's turn queue if it is empty (True if it was)."""
    return bool(conn.eval(_FORGET, 3, pool.turn_queue(worker_id), pool.turn_queue_owners,
                          pool.homed_sessions(worker_id), worker_id))
