"""Cancelling a run or some of its jobs.

`cancel` adds the jobs to their run's canceled set (`pipeline.core.broker.keys.canceled`) and, in the same
Lua call per pool (atomic), removes the queued ones from the pool's queue and its retry schedule,
marks them `canceled` and deletes their staged prompt ids. Jobs in flight stay `started`: the
cancel publishes on the pool's control wake-up channel, and each worker holding one aborts it on
its engine at the next step (`workers.cancel`), writes no shard, commits nothing and marks it
`canceled`. The commit log refuses a canceled job's commit in the same atomic step that would
append it (`pipeline.core.broker.commit_log.append`), so nothing is committed after a cancel returns, even
by a worker that missed the wake-up. Committed shards stay; finished and failed jobs are left as
they are.

A run of agent episodes (`pipeline submit --agent`) is canceled the same way: every episode with no
outcome yet gets a `canceled` one at once (queued ones never start); agent workers stop the ones in
flight within a keep-alive interval (their environments torn down) and their turns never reach
training.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import redis

from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError
from pipeline.core.jobs import episodes
from pipeline.core.jobs.queue import RESULT_TTL_S, rollout_queue
from pipeline.core.jobs.status import job_key

# KEYS: the pool's queue, its retry schedule, the run's canceled set, the run's committed jobs.
# ARGV: the RQ job key prefix, the prompt key prefix, the canceled records' TTL, then the job ids.
# Returns counts: queued (removed now), running (aborted by their workers), finished (a started job
# whose commit is in counts as finished), failed, already canceled, missing (no job record). Only the
# jobs it cancels (queued and running) join the canceled set: the set counts the run's canceled jobs.
_CANCEL = """
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
local wanted = {}
for _, id in ipairs(ids) do wanted[id] = true end
local queued = redis.call('LRANGE', KEYS[1], 0, -1)
local kept, hit = {}, false
for _, id in ipairs(queued) do
  if wanted[id] then hit = true else kept[#kept + 1] = id end
end
if hit then
  redis.call('DEL', KEYS[1])
  for i = 1, #kept, 1000 do
    redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 999, #kept)))
  end
end
local removed, running, finished, failed, canceled, missing = 0, 0, 0, 0, 0, 0
local fenced = {}
for _, id in ipairs(ids) do
  local job = ARGV[1] .. id
  local status = redis.call('HGET', job, 'status')
  if not status then
    missing = missing + 1
  elseif status == 'queued' or status == 'scheduled' or status == 'deferred' then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HSET', job, 'status', 'canceled')
    redis.call('EXPIRE', job, ARGV[3])
    redis.call('DEL', ARGV[2] .. id)
    removed = removed + 1
    fenced[#fenced + 1] = id
  elseif status == 'started' and redis.call('HEXISTS', KEYS[4], id) == 0 then
    running = running + 1
    fenced[#fenced + 1] = id
  elseif status == 'started' or status == 'finished' then
    finished = finished + 1  -- committed: its shard stands, it ends finished
  elseif status == 'canceled' then
    canceled = canceled + 1
  else
    failed = failed + 1
  end
end
for i = 1, #fenced, 1000 do
  redis.call('SADD', KEYS[3], unpack(fenced, i, math.min(i + 999, #fenced)))
end
return {removed, running, finished, failed, canceled, missing}
"""


@dataclass
class CancelResult:
    """What a cancel did, in job counts: `queued` removed before they ran, `running` being aborted
    by their workers, `finished` and `failed` left as they were, `already` canceled before."""

    job_ids: list[str] = field(default_factory=list)
    queued: int = 0
    running: int = 0
    finished: int = 0
    failed: int = 0
    already: int = 0
    missing: int = 0
    episodes: int = 0  # agent episodes canceled (an episode run's: `pipeline.core.jobs.episodes.cancel_run`)

    @property
    def canceled(self) -> int:
        """Jobs this cancel stopped: removed from the queue, or being aborted by their workers."""
        return self.queued + self.running

    def add(self, counts: list[int]) -> None:
        self.queued += counts[0]
        self.running += counts[1]
        self.finished += counts[2]
        self.failed += counts[3]
        self.already += counts[4]
        self.missing += counts[5]


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _batch(conn: redis.Redis, batch_id: str) -> tuple[str, str, list[str]] | None:
    """(run, pool, job ids) of a submitted batch, None if unknown."""
    raw = conn.hmget(keys.batch(batch_id), ["run", "pool", "job_ids"])
    if raw[0] is None:
        return None
    pool = _decode(raw[1]) if raw[1] is not None else keys.DEFAULT_POOL
    return _decode(raw[0]), pool, [j for j in _decode(raw[2] or b"").split(",") if j]


def _targets(conn: redis.Redis, run: str | None, job_ids: list[str] | None) -> dict[tuple[str, str], list[str]]:
    """(run, pool) → the job ids to cancel there."""
    targets: dict[tuple[str, str], list[str]] = defaultdict(list)
    if run is not None:
        batch_ids = sorted(_decode(b) for b in conn.smembers(keys.run_batches(run)))
        if not batch_ids:
            raise PipelineError(f"run {run!r} has no submitted batch on this Redis; check the run name "
                                "(`pipeline status`) and the Redis URL; nothing was canceled")
        for batch_id in batch_ids:
            found = _batch(conn, batch_id)
            if found is not None:
                targets[(found[0], found[1])].extend(found[2])
    unknown: list[str] = []
    batches: dict[str, tuple[str, str, list[str]] | None] = {}
    for job_id in job_ids or []:
        batch_id = job_id.rsplit("-", 1)[0]
        if batch_id not in batches:
            batches[batch_id] = _batch(conn, batch_id)
        found = batches[batch_id]
        if found is None or job_id not in found[2]:
            unknown.append(job_id)
        elif job_id not in targets[(found[0], found[1])]:
            targets[(found[0], found[1])].append(job_id)
    if unknown:
        raise PipelineError(f"{len(unknown)} job id(s) belong to no submitted batch: {', '.join(unknown[:10])}; "
                            "job ids look like '<batch id>-00000' (`Batch.job_ids`); nothing was canceled")
    return targets


def cancel(
    conn: redis.Redis, *, run: str | None = None, job_ids: list[str] | None = None, pool: str | None = None,
) -> CancelResult:
    """Cancel every job of `run` and/or the jobs `job_ids`; with `pool`, only those submitted to it.

    Returns at once: queued jobs are gone when it returns, jobs in flight stop at their worker's
    next engine step. Canceling again is harmless.
    """
    if run is None and not job_ids:
        raise PipelineError("cancel what? name a run (--run NAME) or job ids")
    result = CancelResult()
    info = episodes.run_info(conn, run) if run is not None else None
    if info is not None and (pool is None or info["pool"] == keys.pool_name(pool)):
        result.episodes = episodes.cancel_run(conn, run, info)
        if not job_ids and not conn.exists(keys.run_batches(run)):
            return result  # a run of episodes only
    targets = _targets(conn, run, job_ids)
    if pool is not None:
        wanted = keys.pool_name(pool)
        pools = sorted({p for _, p in targets})
        targets = {(r, p): ids for (r, p), ids in targets.items() if p == wanted}
        if not targets:
            raise PipelineError(f"none of these jobs were submitted to pool {wanted!r} (they are in "
                                f"{', '.join(pools) or 'no pool'}); nothing was canceled")
    script = conn.register_script(_CANCEL)
    prompt_prefix = keys.prompts("")
    for (run_name, pool_name), ids in targets.items():
        queue = rollout_queue(conn, pool_name)
        counts = script(keys=[queue.key, queue.scheduled_job_registry.key, keys.canceled(run_name),
                              keys.run_jobs(run_name)],
                        args=[job_key(""), prompt_prefix, RESULT_TTL_S, *ids])
        result.add([int(c) for c in counts])
        result.job_ids.extend(ids)
    for pool_name in sorted({p for _, p in targets}):
        # Workers holding one of the jobs abort it at once (they also re-check every poll interval).
        conn.publish(keys.pool(pool_name).control_channel, "cancel")
    return result
