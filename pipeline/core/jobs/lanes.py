"""Workers' own lanes: turns routed to one worker, and what becomes of them when it dies.

`pipeline serve` routes a session's turn to its home worker (`pipeline.core.affinity`) by
enqueueing it on that worker's own RQ queue (`keys.PoolKeys.worker_lane_queue_name`), which the
worker takes before the pool's shared lane and its batch queue. A worker registers its lane
(`register`) when it starts. When its registry entry expires (it was killed, or its host
went away), `rehome_orphans`, run by every server that waits on a turn and by every worker of
the pool, moves every job it held (queued, running, or a retry waiting out its backoff) to the
front of the pool's shared lane, where the next free worker takes it; its sessions stop
counting against it. A job it had popped but not yet started is in none of those places (RQ
dequeues from several queues with a BLPOP): the server waiting for it requeues it
(`rescue_popped`). A job moved while its worker still ran it (an entry
expired by a partition, not a death) runs twice, and answers once: the turn log keeps the rows
logged first (`workers.jobs.turn_log`).
"""

from __future__ import annotations

import redis
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from pipeline.core.broker import keys, registry
from pipeline.core.jobs.status import job_key, read_origin

# KEYS: the worker's queue, its intermediate queue, started registry, scheduled registry; the
# shared lane queue; the pool's lane-workers set; the worker's load set.
# ARGV: the worker id, the shared lane queue's name, the job hash prefix. Returns the jobs moved.
_REHOME = """
local moved = {}
local function take(id)
  if not moved[id] then
    moved[id] = true
    local job = ARGV[3] .. id
    if redis.call('EXISTS', job) == 1 then
      redis.call('HSET', job, 'status', 'queued', 'origin', ARGV[2])
      redis.call('LPUSH', KEYS[5], id)
    end
  end
end
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do take(id) end
for _, id in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do take(id) end
for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  take(string.match(member, '^([^:]+)'))
end
for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do take(id) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[7])
redis.call('SREM', KEYS[6], ARGV[1])
local count = 0
for _ in pairs(moved) do count = count + 1 end
return count
"""


# KEYS: the job's hash, the queue it names as its origin, the shared lane queue. ARGV: the job id,
# the shared lane's name. Requeues a job its worker popped and died with before starting it (RQ's
# multi-queue dequeue is a BLPOP: between the pop and the start the job is in no list, no registry).
_RESCUE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' then return 0 end
if redis.call('HGET', KEYS[1], 'origin') ~= ARGV[3] then return 0 end
if redis.call('LPOS', KEYS[2], ARGV[1]) or redis.call('LPOS', KEYS[3], ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'origin', ARGV[2])
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""


def worker_queue(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> Queue:
    return Queue(pool.worker_lane_queue_name(worker_id), connection=conn, serializer=JSONSerializer)


def register(conn: redis.Redis, pool: keys.PoolKeys, worker_id: str) -> None:
    """A worker's lane exists from now on (so its jobs are moved once it is gone)."""
    conn.sadd(pool.lane_workers, worker_id)


def rehome_orphans(conn: redis.Redis, pool: keys.PoolKeys, live: set[str] | None = None) -> int:
    """Move the jobs of every dead worker's lane to the front of the pool's shared lane; the number
    of jobs moved. `live`: the live workers' ids, if the caller has just read them."""
    owners = {member.decode() for member in conn.smembers(pool.lane_workers)}
    if not owners:
        return 0
    if live is None:
        live = {w.worker_id for w in registry.live_workers(conn, pool.name)}
    moved = 0
    script = conn.register_script(_REHOME)
    shared = Queue(pool.lane_queue_name, connection=conn, serializer=JSONSerializer)
    for worker_id in sorted(owners - live):
        queue = worker_queue(conn, pool, worker_id)
        moved += int(script(
            keys=[queue.key, queue.intermediate_queue_key, queue.started_job_registry.key,
                  queue.scheduled_job_registry.key, shared.key, pool.lane_workers, pool.lane_load(worker_id)],
            args=[worker_id, shared.name, Job.redis_job_namespace_prefix]))
    return moved


def rescue_popped(conn: redis.Redis, pool: keys.PoolKeys, job_id: str, live: set[str]) -> bool:
    """Requeue on the shared lane a job still `queued` in the lane of a dead worker but in no list:
    the worker popped it and died before starting it. True if it did."""
    origin = read_origin(conn, job_id)
    prefix = pool.worker_lane_queue_name("")
    if origin is None or not origin.decode().startswith(prefix) or origin.decode()[len(prefix):] in live:
        return False
    shared = Queue(pool.lane_queue_name, connection=conn, serializer=JSONSerializer)
    dead = Queue(origin.decode(), connection=conn, serializer=JSONSerializer)
    return bool(conn.eval(_RESCUE, 3, job_key(job_id), dead.key, shared.key, job_id, shared.name,
                          origin.decode()))
