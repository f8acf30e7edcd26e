"""Request ids are unique within a run: a row's `rollout_id` is `{request id}:{sample}`, and rewards,
verify and readers find rows by it across the run.

A submit stages each job's request ids in a set of its own (`keys.staged_request_ids`) as the job is
packed, from the prompt-staging thread (`pipeline.intake.prompt_staging`), so Redis inserts them while
the submit goes on parsing. Its enqueue transaction then moves them into the run's id set
(`keys.run_request_ids`): a RENAME when the run has none yet (a first submit: no work per id inside
the transaction), else an add of each. A submit into a run that has ids already first checks its
own against them and is refused, nothing enqueued, when one is taken. The run's set and the staged
set are WATCHed from the check to the EXEC, so two submits into one run at the same time cannot both
add an id (one's EXEC fails; it is submitted again).

Each step is a Lua script; a job's ids go as one JSON array (one argument instead of one per id:
redis-py packs each argument in Python, which cost more than Redis's work on them).
"""

from __future__ import annotations

import json

import redis

from pipeline.broker import keys
from pipeline.errors import PipelineError

SHOWN = 10

# KEYS: the staged set. ARGV: a job's ids (a JSON array), the set's TTL in seconds.
_STAGE = """
local ids = cjson.decode(ARGV[1])
for i = 1, #ids, 1000 do
  redis.call('SADD', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return #ids
"""

# KEYS: the run's id set, the staged set. Returns how many staged ids the run has, then the first
# SHOWN of them in sorted order.
_TAKEN = f"""
local taken = redis.call('SINTER', KEYS[1], KEYS[2])
table.sort(taken)
local out = {{#taken}}
for i = 1, math.min(#taken, {SHOWN}) do out[#out + 1] = taken[i] end
return out
"""

# KEYS: the run's id set, the staged set (which the transaction's WATCH proved is there).
_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('RENAME', KEYS[2], KEYS[1])
  redis.call('PERSIST', KEYS[1])
  return 0
end
local ids = redis.call('SMEMBERS', KEYS[2])
for i = 1, #ids, 1000 do
  redis.call('SADD', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
end
redis.call('DEL', KEYS[2])
return #ids
"""


def stage(pipe: redis.client.Pipeline, staged: str, ids: list[str], ttl_s: int) -> None:
    """Queue the adding of a job's `ids` to the submit's staged set `staged` (expiring in `ttl_s`
    unless the enqueue moves them into the run's set) on `pipe`."""
    pipe.eval(_STAGE, 1, staged, json.dumps(ids), ttl_s)


def refuse_taken(pipe: redis.client.Pipeline, run: str, staged: str, count: int) -> None:
    """WATCH the run's id set and the staged set on `pipe` (which must then run MULTI/EXEC, with
    `add`); raise `PipelineError` when the staged set does not hold the submit's `count` (distinct)
    ids, or naming the run and the ids when the run has one of them already."""
    key = keys.run_request_ids(run)
    pipe.watch(key, staged)
    if pipe.scard(staged) != count:
        raise PipelineError("request ids staged in Redis vanished before the jobs were enqueued (evicted or "
                            "flushed?); nothing was enqueued, submit again")
    if not pipe.exists(key):
        return
    count, *shown = pipe.eval(_TAKEN, 2, key, staged)
    if count:
        names = ", ".join(repr(i.decode() if isinstance(i, bytes) else i) for i in shown)
        if count > len(shown):
            names += f" and {count - len(shown)} more"
        raise PipelineError(
            f"run {run!r} already has {count} of these request ids ({names}) from an earlier submit: their rows "
            "would share rollout_ids ('{id}:{sample}'); submit them into another run (--run NAME), or give them new "
            "ids; nothing was enqueued")


def add(pipe: redis.client.Pipeline, run: str, staged: str) -> None:
    """Queue the move of the staged ids into the run's id set on `pipe`, inside its MULTI."""
    pipe.eval(_ADD, 2, keys.run_request_ids(run), staged)
