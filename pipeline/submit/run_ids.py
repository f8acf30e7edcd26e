"""Request ids are unique within a run: a row's `rollout_id` is `{request id}:{sample}`, and rewards,
verify and readers find rows by it across the run.

Every submit adds its request ids to the run's id set (`keys.run_request_ids`) in its enqueue
transaction; a submit into a run that has ids already first checks its own against them and is
refused, nothing enqueued, when one is taken. The set is WATCHed from the check to the EXEC, so two
submits into one run at the same time cannot both add an id (one's EXEC fails; it is submitted again).

Both steps are a Lua script given the ids as one JSON array: one argument instead of one per id
(redis-py packs each argument in Python, which cost more than Redis's work on 20 000 ids).
"""

from __future__ import annotations

import json

import redis

from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError

SHOWN = 10

# KEYS: the run's id set. ARGV: the ids (a JSON array). Returns how many are in the set, then the
# first SHOWN of them in sorted order.
_TAKEN = f"""
local ids = cjson.decode(ARGV[1])
local taken = {{}}
for i = 1, #ids, 1000 do
  local hits = redis.call('SMISMEMBER', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
  for j, hit in ipairs(hits) do
    if hit == 1 then taken[#taken + 1] = ids[i + j - 1] end
  end
end
table.sort(taken)
local out = {{#taken}}
for i = 1, math.min(#taken, {SHOWN}) do out[#out + 1] = taken[i] end
return out
"""

# KEYS: the run's id set. ARGV: the ids (a JSON array).
_ADD = """
local ids = cjson.decode(ARGV[1])
for i = 1, #ids, 1000 do
  redis.call('SADD', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))
end
return #ids
"""


def encode(ids: list[str]) -> str:
    """The ids as the scripts take them."""
    return json.dumps(ids)


def refuse_taken(pipe: redis.client.Pipeline, run: str, ids: str) -> None:
    """WATCH the run's id set on `pipe` (which must then run MULTI/EXEC, with `add`) and raise
    `PipelineError` naming the run and the ids when it holds one of `ids` (`encode`d)."""
    key = keys.run_request_ids(run)
    pipe.watch(key)
    if not pipe.exists(key):
        return
    count, *shown = pipe.eval(_TAKEN, 1, key, ids)
    if count:
        names = ", ".join(repr(i.decode() if isinstance(i, bytes) else i) for i in shown)
        if count > len(shown):
            names += f" and {count - len(shown)} more"
        raise PipelineError(
            f"run {run!r} already has {count} of these request ids ({names}) from an earlier submit: their rows "
            "would share rollout_ids ('{id}:{sample}'); submit them into another run (--run NAME), or give them new "
            "ids; nothing was enqueued")


def add(pipe: redis.client.Pipeline, run: str, ids: str) -> None:
    """Queue the adding of `ids` (`encode`d) to the run's id set on `pipe`, inside its MULTI."""
    pipe.eval(_ADD, 1, keys.run_request_ids(run), ids)
