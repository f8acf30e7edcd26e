"""Reconciling jobs a Redis failover orphaned: requeue a job whose state says it is waiting or
running but which nothing holds.

Replication is asynchronous, so a master that dies (or that the sentinels demote while it still
answers) can take its last writes with it, and the workers then carry on against the promoted
replica, which has an older state. Most of what that leaves behind RQ's own registries already
cover (a job whose end was lost stays in the started registry under an execution nobody
refreshes, which `workers.jobs.maintenance` finds abandoned). What they cannot cover is a job whose
status says `queued`, `started`, `scheduled` or `deferred` although it is in none of the places
a worker or the maintenance would ever take it from: not in its queue, not in the intermediate
queue, not in the started registry (under any execution, live or expired), not in the scheduled
or deferred registry. Nothing would ever run or end it, and its batch would wait forever. A job
`finished` without its commit in the run's commit log (a commit lost while the end survived) is
orphaned the same way: its rows would be missing. And a retry still scheduled for a job that has
ended (RQ took it for abandoned, its started-registry entry having outlived a lost end, while its
worker ran it to the end) is dropped rather than run again.

Each sweep looks at the jobs of the pool's open batches (`pipeline.core.broker.keys.PoolKeys.open_batches`:
every submit adds its batch; a sweep drops a batch once all its jobs have ended, committed, over
two sweeps) and reads, in one transaction, the pool's RQ queue (its batch queue; agent turns are no
RQ jobs), its intermediate queue and its registries. A job found
orphaned twice, at least `grace_s` apart, is requeued at the front of its own queue (its origin)
(status `queued`), in one Lua script that first checks again, atomically, that its status is
still the one seen and that it is still in none of those places of any of the pool's queues. Live workers re-add their
started-registry entries at every heartbeat (`workers.process.heartbeat`), so a job a live worker
still runs is never orphaned for longer than a heartbeat, and `grace_s` (the maintenance's
`stuck_after_s`) is far longer. Should a job run twice anyway, nothing is duplicated: it
rewrites the same shard and the commit log keeps one commit per job (readers dedupe by job id).
Requeueing spends none of the job's retries: the fault was Redis's, not the job's.

Sweeps are frequent (every maintenance interval) for a while after the Redis master changed (its
replication id differs from the one seen last, including at a worker's start), and otherwise
every `IDLE_SWEEP_S`, as long as no job is suspected. For `grace_s` after a change, no job is
taken for abandoned (`settling`): no heartbeat reached any master during the failover, so the
started-registry entries of jobs live workers still run may have expired; RQ would retry every
one of them (spending a retry each, and running them twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
from rq.queue import Queue

from pipeline.core.broker import keys
from pipeline.core.jobs.status import job_key, read_origin, read_status

log = logging.getLogger(__name__)

WAITING = ("queued", "started", "scheduled", "deferred")
ENDED = ("finished", "failed", "stopped", "canceled")
IDLE_SWEEP_S = 600.0  # between sweeps while the master has not changed and nothing is suspected
WINDOW_GRACES = 20  # sweeps stay frequent this many grace periods after the master changed

# KEYS: the job's hash, the run's committed jobs, the queue to requeue it in, then per queue of
# the pool five: the queue, the intermediate queue, the started, scheduled and deferred
# registries. ARGV: the job id, the status the sweep saw. Requeues the job (at the front) only if
# it is still orphaned; returns 1 if it did.
_REQUEUE_ORPHAN = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= ARGV[2] then return 0 end
if status == 'finished' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local prefix = ARGV[1] .. ':'
for q = 4, #KEYS, 5 do
  if redis.call('LPOS', KEYS[q], ARGV[1]) or redis.call('LPOS', KEYS[q + 1], ARGV[1]) then return 0 end
  if redis.call('ZSCORE', KEYS[q + 3], ARGV[1]) or redis.call('ZSCORE', KEYS[q + 4], ARGV[1]) then return 0 end
  for _, member in ipairs(redis.call('ZRANGE', KEYS[q + 2], 0, -1)) do
    if string.sub(member, 1, #prefix) == prefix then return 0 end
  end
end
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""


# KEYS: the job's hash, the scheduled registry. ARGV: the job id, the (ended) status the sweep saw.
_DROP_ENDED_RETRY = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then return 0 end
return redis.call('ZREM', KEYS[2], ARGV[1])
"""


@dataclass
class _Seen:
    """What a sweep saw of one job (or batch) first, and when."""

    state: str
    since: float = field(default_factory=time.monotonic)


class Reconciler:
    """Sweeps one pool's open batches for orphaned jobs and requeues them (see the module doc);
    `queues`: every queue of the pool, the batch queue last (a job whose origin is none of them
    goes back there)."""

    def __init__(self, conn: redis.Redis, queues: Sequence[Queue], pool: str, *, grace_s: float,
                 interval_s: float) -> None:
        self.conn = conn
        self.queues = list(queues)
        self.pool = keys.pool(pool)
        self.grace_s = grace_s
        self.interval_s = interval_s
        self._script = conn.register_script(_REQUEUE_ORPHAN)
        self._drop_ended_retry = conn.register_script(_DROP_ENDED_RETRY)
        self._replid: str | None = None
        self._changed_at: float | None = None  # when the master last changed (monotonic)
        self._frequent_until = 0.0
        self._next_sweep = 0.0
        self._orphans: dict[str, _Seen] = {}  # job id -> status seen orphaned
        self._ended: dict[str, _Seen] = {}  # batch id -> seen with every job ended and committed

    def observe_master(self) -> None:
        """Note the Redis master's replication id; a change (a failover, or a restart on other data)
        makes sweeps frequent for a while and starts a settling period (`settling`)."""
        now = time.monotonic()
        replid = self._master_replid()
        if replid is None or replid == self._replid:
            return
        if self._replid is not None:
            log.warning("the Redis master changed (replication id %s -> %s): looking for jobs its lost writes "
                        "orphaned; abandoned jobs are looked for again in %.0f s", self._replid, replid,
                        self.grace_s)
            self._changed_at = now
        self._replid = replid
        self._frequent_until = now + WINDOW_GRACES * self.grace_s
        self._next_sweep = now

    def settling(self) -> bool:
        """Whether the master changed less than `grace_s` ago: running jobs' started-registry entries
        may have expired during the failover (no heartbeat reached any master), and their workers'
        heartbeats have not refreshed them yet, so none of them may be taken for abandoned."""
        return self._changed_at is not None and time.monotonic() - self._changed_at < self.grace_s

    def due(self) -> bool:
        """Whether a sweep is due now (after a change of master: every call; else now and then)."""
        return time.monotonic() >= self._next_sweep

    def _master_replid(self) -> str | None:
        try:
            value = self.conn.info("replication").get("master_replid")
        except redis.ResponseError:  # a server without INFO (fakeredis): no failovers to notice
            return None
        return str(value) if value else None

    def sweep(self) -> list[str]:
        """One sweep; the ids of the jobs requeued."""
        now = time.monotonic()
        open_batches = sorted(m.decode() for m in self.conn.smembers(self.pool.open_batches))
        batches = self._batches(open_batches)
        statuses = self._statuses(batches)
        held, scheduled = self._held()
        requeued: list[str] = []
        orphans: dict[str, _Seen] = {}
        for batch_id, (run, job_ids) in batches.items():
            ended = True
            for job_id in job_ids:
                status, committed = statuses[job_id]
                if status in ENDED and (status != "finished" or committed):
                    if job_id in scheduled:
                        self._drop_retry(job_id, status, scheduled[job_id])
                    continue
                if status is None:  # the job's record expired (results are kept for days): nothing to run
                    continue
                ended = False
                if job_id in held or status not in (*WAITING, "finished"):
                    continue
                seen = self._orphans.get(job_id)
                if seen is None or seen.state != status:
                    orphans[job_id] = _Seen(status)
                    continue
                if now - seen.since < self.grace_s:
                    orphans[job_id] = seen
                    continue
                if self._requeue(job_id, run, status):
                    requeued.append(job_id)
            self._close_if_ended(batch_id, ended, now)
        for batch_id in set(self._ended) - set(batches):
            del self._ended[batch_id]
        self._orphans = orphans
        frequent = orphans or self._ended or now < self._frequent_until
        self._next_sweep = now + (self.interval_s if frequent else IDLE_SWEEP_S)
        return requeued

    def _batches(self, batch_ids: list[str]) -> dict[str, tuple[str, list[str]]]:
        """Each open batch's run and job ids (a batch whose record is gone is dropped from the set)."""
        with self.conn.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hmget(keys.batch(batch_id), "run", "job_ids")
            records = pipe.execute()
        batches: dict[str, tuple[str, list[str]]] = {}
        for batch_id, (run, job_ids) in zip(batch_ids, records, strict=True):
            if run is None or job_ids is None:
                self.conn.srem(self.pool.open_batches, batch_id)
                continue
            batches[batch_id] = (run.decode(), job_ids.decode().split(","))
        return batches

    def _statuses(self, batches: dict[str, tuple[str, list[str]]]) -> dict[str, tuple[str | None, bool]]:
        """Each job's RQ status and whether its run's commit log has it."""
        with self.conn.pipeline(transaction=False) as pipe:
            for run, job_ids in batches.values():
                for job_id in job_ids:
                    read_status(pipe, job_id)
                pipe.hmget(keys.run_jobs(run), job_ids)
            replies = iter(pipe.execute())
        statuses: dict[str, tuple[str | None, bool]] = {}
        for _, job_ids in batches.values():
            raw = [next(replies) for _ in job_ids]
            committed = next(replies)
            for job_id, status, commit in zip(job_ids, raw, committed, strict=True):
                statuses[job_id] = (status.decode() if status else None, commit is not None)
        return statuses

    def _places(self, queue: Queue) -> list[str]:
        """A queue's five places of a job, in `_REQUEUE_ORPHAN`'s order."""
        return [queue.key, queue.intermediate_queue_key, queue.started_job_registry.key,
                queue.scheduled_job_registry.key, queue.deferred_job_registry.key]

    def _held(self) -> tuple[set[str], dict[str, str]]:
        """Every job id in a queue of the pool, its intermediate queue or a registry, read in one
        transaction; and those of the scheduled registries (retries waiting out their backoff), each
        with its registry's key."""
        with self.conn.pipeline(transaction=True) as pipe:
            for queue in self.queues:
                pipe.lrange(queue.key, 0, -1)
                pipe.lrange(queue.intermediate_queue_key, 0, -1)
                pipe.zrange(queue.started_job_registry.key, 0, -1)
                pipe.zrange(queue.scheduled_job_registry.key, 0, -1)
                pipe.zrange(queue.deferred_job_registry.key, 0, -1)
            replies = iter(pipe.execute())
        held: set[str] = set()
        scheduled_in: dict[str, str] = {}
        for queue in self.queues:
            queued, intermediate, started, scheduled, deferred = (next(replies) for _ in range(5))
            held.update(m.decode() for m in (*queued, *intermediate, *scheduled, *deferred))
            held.update(m.decode().split(":", 1)[0] for m in started)  # `job id:execution id`
            scheduled_in.update((m.decode(), queue.scheduled_job_registry.key) for m in scheduled)
        return held, scheduled_in

    def _drop_retry(self, job_id: str, status: str, registry: str) -> None:
        """A retry scheduled for a job that has ended since: a failover's lost writes made RQ take the
        job for abandoned while its worker still ran it to the end. Dropped, not run again."""
        if self._drop_ended_retry(keys=[job_key(job_id), registry], args=[job_id, status]):
            log.warning("job %s is %s, but a retry of it was scheduled (a Redis failover made it look "
                        "abandoned?); the retry is dropped", job_id, status)

    def _requeue(self, job_id: str, run: str, status: str) -> bool:
        origin = read_origin(self.conn, job_id)
        home = next((q for q in self.queues if origin is not None and q.name == origin.decode()), self.queues[-1])
        places = [key for queue in self.queues for key in self._places(queue)]
        done = self._script(keys=[job_key(job_id), keys.run_jobs(run), home.key, *places], args=[job_id, status])
        if done:
            what = "finished but its commit is missing" if status == "finished" else f"{status} but held nowhere"
            log.warning("job %s of run %s was %s (state lost in a Redis failover?); requeued it", job_id, run, what)
        return bool(done)

    def _close_if_ended(self, batch_id: str, ended: bool, now: float) -> None:
        """Drop a batch from the open set once seen ended (every job ended, committed) twice, `grace_s` apart."""
        if not ended:
            self._ended.pop(batch_id, None)
            return
        seen = self._ended.get(batch_id)
        if seen is None:
            self._ended[batch_id] = _Seen("ended", now)
        elif now - seen.since >= self.grace_s:
            self.conn.srem(self.pool.open_batches, batch_id)
            del self._ended[batch_id]
