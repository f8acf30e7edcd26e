"""Workers' own lanes: turns routed to one worker, a plain Redis list each, and what becomes of them
when it dies.

`pipeline serve` routes a session's turn to its home worker (`pipeline.core.affinity`) by pushing
a `LaneItem` (the job's payload as JSON, no RQ job) onto that worker's lane list
(`keys.PoolKeys.turn_lane`). The worker moves each item atomically into its in-flight list when
it takes it (`take`: one BLMOVE, so an item is always in one of the two lists until it is done),
runs it like any job, and removes it once its turns are logged and answered (`done`), puts it
back (`hand_back`, `retry`) or fails its turns (`fail`: an error for each turn in its server's inbox, and
a failure mark the server reads, `turn_failure`). A turn so costs a push, a move and a remove
instead of RQ's job lifecycle (hash, registries, executions, results: ~60 commands a job).

When a worker's registry entry expires (it was killed, or its host went away), `rehome_orphans`,
run by every server that waits on a turn and by every worker of the pool, turns every item of its
two lists into an RQ job of the same id on the pool's shared lane, where the next free worker
takes it (its checkpoint, kept by job id, with it): one script per item removes it and writes the
job, so an item moves once or not at all. An item moved while its worker still ran it (an entry
expired by a partition, not a death) runs twice, and answers once: the turn log keeps the rows
logged first (`workers.jobs.turn_commits`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

import redis
from redis.client import Pipeline
from rq import Queue, Retry
from rq.serializers import JSONSerializer
from rq.utils import now

from pipeline.core.broker import keys, registry
from pipeline.core.jobs import replies
from pipeline.core.jobs.queue import JOB_FUNCTION, RESULT_TTL_S, retry_intervals
from pipeline.core.jobs.status import job_key
from schemas.turn_failure import TurnFailure

FAILED_TTL_S = 3600  # how long a failed turn's reason is kept for its server (`turn_failure`)


@dataclass(frozen=True)
class LaneItem:
    """One job of agent turns in a worker's lane: what RQ's job hash would hold, as one JSON value."""

    job_id: str
    payload: dict[str, Any]  # `schemas.job_payload.JobPayload` as JSON, with its turns
    needs: dict[str, Any]
    description: str
    timeout_s: int
    retries_left: int
    enqueued_at: float  # epoch seconds
    attempts: int = 0  # runs begun before (handed back or retried): a checkpoint may hold its tokens

    def encode(self) -> bytes:
        # The fields as they are (`asdict` would deep-copy the payload first, on the server's hot path).
        return json.dumps(vars(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> LaneItem:
        return cls(**json.loads(raw))

    @property
    def turn_ids(self) -> list[str]:
        return [turn["turn_id"] for turn in self.payload.get("turns") or []]

    def again(self, *, retry: bool) -> LaneItem:
        """The item queued again after a run (`retry`: one retry spent)."""
        return replace(self, attempts=self.attempts + 1, retries_left=self.retries_left - int(retry))

    def rq_job(self, queue: Queue) -> Any:
        """This item as an RQ job of `queue` (not saved): what a worker runs, what a rehome writes."""
        retries = self.retries_left
        job = queue.create_job(
            JOB_FUNCTION, args=(self.payload,), job_id=self.job_id, timeout=self.timeout_s, result_ttl=RESULT_TTL_S,
            failure_ttl=RESULT_TTL_S, description=self.description,
            retry=Retry(max=retries, interval=retry_intervals(retries)) if retries else None,
            meta={"run": self.payload.get("run"), "needs": self.needs})
        job.origin = queue.name
        return job


def turn_job_value(job_id: str, worker: str) -> str:
    """What `keys.turn_job` holds for a turn in `worker`'s lane (a rehome writes the bare job id)."""
    return f"{job_id}@{worker}"


def parse_turn_job(value: bytes | None) -> tuple[str | None, str | None]:
    """(job id, the worker whose lane holds it: None once it is an RQ job) from `keys.turn_job`."""
    if value is None:
        return None, None
    job_id, _, worker = value.decode().partition("@")
    return job_id, worker or None


def push(pipe: Pipeline, pool: keys.PoolKeys, worker: str, item: LaneItem) -> None:
    """Queue `item` on `worker`'s lane, then note where its turns are (in a pipeline).

    The item first: a failover (replication is asynchronous) or a restart from the append-only file
    loses a suffix of the writes, so a turn whose job key survives has its item too, and a waiter
    that finds no job key fails the turn at once (`pipeline.serve.turn_wait`: the client's retry
    runs it again) instead of waiting for an item that is gone."""
    # The worker registered its lane when it started (`register`); one that died after it was chosen
    # and whose lane was moved and forgotten since is registered again by the turn's waiter.
    pipe.lpush(pool.turn_lane(worker), item.encode())
    for turn_id in item.turn_ids:
        pipe.set(keys.turn_job(turn_id), turn_job_value(item.job_id, worker), ex=2 * item.timeout_s)


def take(conn: redis.Redis, pool: keys.PoolKeys, worker: str, timeout_s: float) -> bytes | None:
    """The next item of `worker`'s lane, moved into its in-flight list (None after `timeout_s`)."""
    return conn.blmove(pool.turn_lane(worker), pool.turn_lane_in_flight(worker), timeout_s, "RIGHT", "LEFT")


def queued(conn: redis.Redis | Pipeline, pool: keys.PoolKeys, worker: str) -> Any:
    """How many items wait in `worker`'s lane."""
    return conn.llen(pool.turn_lane(worker))


def done(conn: redis.Redis | Pipeline, pool: keys.PoolKeys, worker: str, raw: bytes) -> None:
    """The item's turns are answered: it leaves the in-flight list."""
    conn.lrem(pool.turn_lane_in_flight(worker), 1, raw)


# KEYS: the in-flight list, the lane. ARGV: the item as taken, the item to queue, 1: take it next.
_REQUEUE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if ARGV[3] == '1' then redis.call('RPUSH', KEYS[2], ARGV[2]) else redis.call('LPUSH', KEYS[2], ARGV[2]) end
return 1
"""


def hand_back(conn: redis.Redis, pool: keys.PoolKeys, worker: str, raw: bytes, item: LaneItem) -> bool:
    """Put a taken item back, to be taken next, no retry spent (shutdown, engine failure). False if
    it was no longer in flight (moved by a rehome)."""
    return bool(conn.eval(_REQUEUE, 2, pool.turn_lane_in_flight(worker), pool.turn_lane(worker), raw,
                          item.again(retry=False).encode(), "1"))


def retry(conn: redis.Redis, pool: keys.PoolKeys, worker: str, raw: bytes, item: LaneItem) -> bool:
    """Queue a failed item again with one retry fewer (behind what waits). False if no longer in flight."""
    return bool(conn.eval(_REQUEUE, 2, pool.turn_lane_in_flight(worker), pool.turn_lane(worker), raw,
                          item.again(retry=True).encode(), "0"))


def fail(conn: redis.Redis, pool: keys.PoolKeys, worker: str, raw: bytes, item: LaneItem,
         failure: TurnFailure) -> None:
    """The item failed for good: each turn's server gets `failure` (in its inbox, and `turn_failure`)."""
    error = failure.encode()
    with conn.pipeline(transaction=True) as pipe:
        done(pipe, pool, worker, raw)
        for turn_id in item.turn_ids:
            pipe.set(keys.turn_failed(turn_id), error, ex=FAILED_TTL_S)
        replies.push(pipe, ((turn["reply_to"], turn["turn_id"], error) for turn in item.payload.get("turns") or []))
        pipe.execute()


def turn_failure(conn: redis.Redis, turn_id: str) -> TurnFailure | None:
    """Why the turn's lane job failed for good, or None if it did not."""
    raw = conn.get(keys.turn_failed(turn_id))
    return None if raw is None else TurnFailure.decode(raw)


def register(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> None:
    """A worker's lane exists from now on (so its items are moved once it is gone)."""
    conn.sadd(pool.lane_workers, worker_id)


# KEYS: the list holding the item, the job's hash, the shared lane's queue, RQ's set of queues, then
# each turn's `turn_job` key. ARGV: the item, the job id, the shared lane's key, the turn keys' TTL,
# then the job hash's fields and values. The item leaves its list and becomes a queued RQ job, or
# nothing happens (another rehome moved it first).
_MOVE = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('LPUSH', KEYS[3], ARGV[2])
for i = 5, #KEYS do redis.call('SET', KEYS[i], ARGV[2], 'EX', ARGV[4]) end
return 1
"""

# KEYS: the lane, the in-flight list, the pool's lane-workers set, the worker's load set. ARGV: the
# worker id. A dead worker leaves the pool's lanes once both its lists are empty.
_FORGET = """
if redis.call('LLEN', KEYS[1]) > 0 or redis.call('LLEN', KEYS[2]) > 0 then return 0 end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return 1
"""


def rehome_orphans(conn: redis.Redis, pool: keys.PoolKeys, live: set[str] | None = None) -> int:
    """Make every item of every dead worker's lane a job at the front of the pool's shared lane (the
    items it had taken first, oldest first); the number of items moved. `live`: the live workers'
    ids, if the caller has just read them."""
    owners = {member.decode() for member in conn.smembers(pool.lane_workers)}
    if not owners:
        return 0
    if live is None:
        live = {w.worker_id for w in registry.live_workers(conn, pool.name)}
    shared = Queue(pool.lane_queue_name, connection=conn, serializer=JSONSerializer)
    move, forget = conn.register_script(_MOVE), conn.register_script(_FORGET)
    moved = 0
    for worker_id in sorted(owners - live):
        # Each item goes to the front, newest first, so that the oldest ends up first: a list's
        # newest item is at its left end, and the items taken (in flight) are older than the lane's.
        for source in (pool.turn_lane(worker_id), pool.turn_lane_in_flight(worker_id)):
            for raw in conn.lrange(source, 0, -1):
                item = LaneItem.decode(raw)
                job = item.rq_job(shared)
                job.enqueued_at = now()
                fields = [part if isinstance(part, bytes | str) else str(part)  # a str enum: its value
                          for pair in job.to_dict().items() for part in pair]
                moved += int(move(keys=[source, job_key(item.job_id), shared.key, Queue.redis_queues_keys,
                                        *(keys.turn_job(t) for t in item.turn_ids)],
                                  args=[raw, item.job_id, shared.key, 2 * item.timeout_s, *fields]))
        forget(keys=[pool.turn_lane(worker_id), pool.turn_lane_in_flight(worker_id), pool.lane_workers,
                     pool.lane_load(worker_id)], args=[worker_id])
    return moved


def new_item(job_id: str, payload: dict[str, Any], needs: dict[str, Any], description: str, *, timeout_s: int,
             retries: int) -> LaneItem:
    return LaneItem(job_id, payload, needs, description, timeout_s, retries, time.time())
