"""The format of a run's agent-turn log (`keys.turn_log`), in one place for its writer and readers.

Workers append each turn's rows once (`COMMIT_SCRIPT`, run by `workers.jobs.turn_commits.commit_turns`)
as a stream entry of two fields, the turn id (`TURN`) and its rows as Arrow IPC (`ROWS`), index it
by turn id (`keys.turn_log_jobs`) and push the rows to their server's inbox
(`pipeline.core.jobs.replies`); they later flush the oldest entries to a shard. The server
(`pipeline.serve.dispatch`) reads one turn back, the readers (`pipeline.read.lineage_rows`) a run's
unflushed turns.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa
import redis

from pipeline.core.broker import keys
from schemas.shard import rows_from_ipc

TURN = b"turn"
ROWS = b"rows"

# KEYS: turn log, turn index, the server's inbox, then each turn's shard key. ARGV: the inbox's
# ttl, then each turn's id and rows (IPC). Each turn's rows are logged once per turn id, and its
# server is answered with the rows logged first: a duplicate run of the job (an item moved to the
# shared lane while its worker still ran it) answers what the log holds, and nothing for a turn
# whose entry was flushed already (its waiter reads the shard). The lookups are one HMGET and one
# EXISTS for all the turns, and all the answers one push. Returns, per turn, 1 if logged now.
COMMIT_SCRIPT = """
local n = math.floor(#ARGV / 2)
local turn_ids = {}
for i = 1, n do turn_ids[i] = ARGV[2 * i] end
local logged = redis.call('HMGET', KEYS[2], unpack(turn_ids))
local any_flushed = redis.call('EXISTS', unpack(KEYS, 4, 3 + n)) > 0
local entries, firsts = {}, {}
for i = 1, n do
  local turn, rows = ARGV[2 * i], ARGV[2 * i + 1]
  firsts[i] = 0
  if any_flushed and redis.call('EXISTS', KEYS[3 + i]) == 1 then
    -- flushed: nothing to answer here
  elseif logged[i] then
    local entry = redis.call('XRANGE', KEYS[1], logged[i], logged[i])
    if #entry == 1 then
      local fields = entry[1][2]
      for j = 1, #fields, 2 do
        if fields[j] == 'rows' then entries[#entries + 1] = turn .. '\\n' .. fields[j + 1] end
      end
    end
  else
    local id = redis.call('XADD', KEYS[1], '*', 'turn', turn, 'rows', rows)
    redis.call('HSET', KEYS[2], turn, id)
    entries[#entries + 1] = turn .. '\\n' .. rows
    firsts[i] = 1
  end
end
if #entries > 0 then
  redis.call('RPUSH', KEYS[3], unpack(entries))
  redis.call('EXPIRE', KEYS[3], ARGV[1])
end
return firsts
"""


def entry_rows(fields: Mapping[bytes, bytes]) -> pa.Table:
    """The rows of one turn-log entry."""
    return rows_from_ipc(fields[ROWS])


def entry_turn(fields: Mapping[bytes, bytes]) -> str:
    """The turn id of one turn-log entry."""
    return fields[TURN].decode()


def logged_turn(conn: redis.Redis, run: str, turn_id: str) -> pa.Table | None:
    """A turn's rows while they are still in the run's log (None once flushed, or never logged)."""
    entry_id = conn.hget(keys.turn_log_jobs(run), turn_id)
    entries = conn.xrange(keys.turn_log(run), entry_id, entry_id) if entry_id else []
    return entry_rows(entries[0][1]) if entries else None


def unflushed(conn: redis.Redis, run: str) -> list[pa.Table]:
    """Every turn of the run still in its log, oldest first."""
    return [entry_rows(fields) for _, fields in conn.xrange(keys.turn_log(run))]


def is_logged(conn: redis.Redis, run: str, turn_id: str) -> bool:
    """Whether the turn's rows were logged (still in the run's log, or flushed to a shard)."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.hexists(keys.turn_log_jobs(run), turn_id)
        pipe.exists(keys.turn_shard(turn_id))
        return any(pipe.execute())
