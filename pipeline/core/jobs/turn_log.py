"""The format of a run's agent-turn log (`keys.turn_log`), in one place for its writer and readers.

Workers append each turn's rows once (`COMMIT_SCRIPT`, run by `workers.jobs.turn_log.commit_turns`)
as a stream entry of two fields, the turn id (`TURN`) and its rows as Arrow IPC (`ROWS`), index it
by turn id (`keys.turn_log_jobs`) and push the rows to their server's inbox
(`pipeline.core.jobs.replies`); they later flush the oldest entries to a shard. The server
(`pipeline.serve.lane`) reads one turn back, the readers (`pipeline.read.trajectories`) a run's
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

# KEYS: turn log, turn index, the server's inbox, the turn's shard key. ARGV: turn id, rows (IPC),
# inbox ttl. Logs the rows once per turn id; answers (an inbox entry, `pipeline.core.jobs.replies`)
# with the rows logged first (a duplicate run of the job answers what the log holds; nothing once
# that entry was flushed: its waiter reads the shard). The run goes into TURN_RUNS beside it
# (`workers.jobs.turn_log.commit_turns`), once a job.
COMMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 'flushed'} end
local logged = redis.call('HGET', KEYS[2], ARGV[1])
if not logged then
  local id = redis.call('XADD', KEYS[1], '*', 'turn', ARGV[1], 'rows', ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], id)
  redis.call('RPUSH', KEYS[3], ARGV[1] .. '\\n' .. ARGV[2])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  return {1, id}
end
local entry = redis.call('XRANGE', KEYS[1], logged, logged)
if #entry == 1 then
  local fields = entry[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'rows' then
      redis.call('RPUSH', KEYS[3], ARGV[1] .. '\\n' .. fields[i + 1])
      redis.call('EXPIRE', KEYS[3], ARGV[3])
    end
  end
end
return {0, logged}
"""

# `COMMIT_SCRIPT` for all the turns of a job no run of which began before (an own-lane item never
# handed back, retried or moved), all answered to one server: the turns, new ids, cannot be logged
# yet, so nothing is looked up, and their answers go to the inbox in one push.
# KEYS: turn log, turn index, the server's inbox. ARGV: inbox ttl, then each turn's id and rows.
COMMIT_FIRST_SCRIPT = """
local entries = {}
for i = 2, #ARGV, 2 do
  local id = redis.call('XADD', KEYS[1], '*', 'turn', ARGV[i], 'rows', ARGV[i + 1])
  redis.call('HSET', KEYS[2], ARGV[i], id)
  entries[#entries + 1] = ARGV[i] .. '\\n' .. ARGV[i + 1]
end
redis.call('RPUSH', KEYS[3], unpack(entries))
redis.call('EXPIRE', KEYS[3], ARGV[1])
return #entries
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
