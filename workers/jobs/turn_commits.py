"""Committing agent turns (`pipeline serve`): rows logged once, answered at once, written many turns to a shard.

A turn is one request of a job of turns (a server puts the turns that
reach it together in one job). Its rows are not a shard of their own (a shard per turn would
leave thousands of tiny files per run): `commit_turns` appends each turn's rows, as Arrow IPC,
to the run's turn log (a Redis stream) and pushes them to the inbox of the server waiting for
them (`pipeline.core.jobs.replies`), one script for the job's turns, at most once per turn id (a
job run twice answers with the rows logged first). `flush_turns` writes the oldest turns of a
run's log to one shard (at most `turns` turns, or whatever is there once the oldest is
`max_age_s` old), appends it to the run's commit log like any shard, then deletes those entries.
Every worker runs a `TurnFlusher`; a lock per run lets one flush at a time. A flush that dies
before its delete leaves the entries in the log: the next one writes them again to the same
shard path (named by the first entry's id), so each turn's rows land in exactly one committed
shard; readers dedupe commits by job id.

Until flushed, a turn's rows are read from the log (`pipeline.read.lineage_rows`).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis

from pipeline.core.broker import commit_log, keys
from pipeline.core.jobs import replies, turn_stream
from pipeline.core.jobs import turn_log as turn_log_format
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest
from schemas.shard import rows_to_ipc
from workers.errors import WorkerError
from workers.rows.shard_writer import PendingShard
from workers.runtime.periodic import Periodic

log = logging.getLogger(__name__)

COMMIT_SHA = hashlib.sha1(turn_log_format.COMMIT_SCRIPT.encode()).hexdigest()
TURN_SHARD_TTL_S = 4 * 3600  # how long a flushed turn's shard is remembered (`keys.turn_shard`)
DEFAULT_SHARD_TURNS = 256
DEFAULT_SHARD_AGE_S = 10.0
FLUSH_CHECK_S = 5.0  # how often a worker looks at the turn logs (a shard is due at 10 s or 256 turns)
LOCK_TTL_MS = 120_000

# KEYS: turn log, TURN_RUNS. ARGV: run. A run whose log is empty leaves the set (atomically, so a
# turn logged meanwhile keeps it there).
_FORGET_IF_EMPTY = """
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# KEYS: lock. ARGV: token. Release only a lock this flusher holds.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def commit_turns(job: JobPayload, requests: Sequence[RolloutRequest], table: pa.Table,
                 conn: redis.Redis) -> dict[str, Any]:
    """Log each turn's rows (once per turn id) and answer its server; return the job's summary.

    The table holds the job's rows in request order, `n` rows per request; the turns answered to one
    server are logged and answered by one script, all of them in one round trip."""
    assert job.turns is not None
    slices, start = [], 0
    for request in requests:
        slices.append(rows_to_ipc(table.slice(start, request.sampling_params.n)))
        start += request.sampling_params.n
    by_server: dict[str, list[tuple[str, bytes]]] = {}
    for turn, rows in zip(job.turns, slices, strict=True):
        by_server.setdefault(turn.reply_to, []).append((turn.turn_id, rows))

    def commit() -> list[Any]:
        # EVALSHA straight, not redis-py's script in a pipeline (which asks SCRIPT EXISTS every time):
        # a Redis without the script (restarted, failed over) says so, and it is loaded and sent again.
        with conn.pipeline(transaction=False) as pipe:
            for server_id, turns in by_server.items():
                pipe.evalsha(COMMIT_SHA, 3 + len(turns), keys.turn_log(job.run), keys.turn_log_jobs(job.run),
                             keys.serve_inbox(server_id), *(keys.turn_shard(turn_id) for turn_id, _ in turns),
                             replies.INBOX_TTL_S, *(v for turn in turns for v in turn))
            # After the log's entries: a flusher that finds the run's log empty forgets the run
            # (`_FORGET_IF_EMPTY`); this puts it back once the entries are there.
            pipe.sadd(keys.TURN_RUNS, job.run)
            for turn in job.turns:  # after the answers: a server reading the stream finds the rows at its end
                if turn.stream:
                    turn_stream.end(pipe, turn.turn_id)
            return [first for firsts in pipe.execute()[: len(by_server)] for first in firsts]

    try:
        logged = commit()
    except redis.exceptions.NoScriptError:  # no turn was logged (a streamed turn's end marker twice: read once)
        conn.script_load(turn_log_format.COMMIT_SCRIPT)
        logged = commit()
    if start != table.num_rows:
        raise WorkerError(f"job {job.job_id}: {table.num_rows} rows for {start} samples of its turns")
    rows = table.num_rows
    tokens = int(pc.sum(table.column("completion_tokens")).as_py() or 0) if rows else 0
    oldest = int(pc.min(table.column("weight_version")).as_py()) if rows else None
    return {"turns": len(job.turns), "logged": sum(int(first) for first in logged), "rows": rows,
            "tokens": tokens, "weight_version": oldest}


def _unify(tables: list[pa.Table]) -> pa.Table:
    """One table of turns whose routed-experts columns may differ in width (uint8/uint16)."""
    try:
        return pa.concat_tables(tables)  # one schema, the usual case (hashing each table's schema costs more)
    except pa.ArrowInvalid:
        pass
    wide = tables[0].schema
    index = wide.get_field_index("routed_experts")
    wide = wide.set(index, wide.field(index).with_type(pa.list_(pa.uint16())))
    return pa.concat_tables([t.cast(wide) for t in tables])


def _due(conn: redis.Redis, run: str, turns: int, max_age_s: float) -> bool:
    """Whether `run`'s turn log holds a shard's worth of turns or one `max_age_s` old, or is empty
    (to be forgotten): two light reads in one round trip, before any lock is taken."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.xlen(keys.turn_log(run))
        pipe.xrange(keys.turn_log(run), count=1)
        length, first = pipe.execute()
    if not first:
        return True
    age = time.time() - int(first[0][0].decode().split("-")[0]) / 1000
    return length >= turns or age >= max_age_s


def flush_turns(conn: redis.Redis, run: str, *, turns: int = DEFAULT_SHARD_TURNS,
                max_age_s: float = DEFAULT_SHARD_AGE_S, force: bool = False) -> str | None:
    """Write the oldest turns of `run`'s log to one shard when `turns` are waiting, or the oldest
    is `max_age_s` old (or `force`); return the shard's URL, None when nothing was written."""
    if not force and not _due(conn, run, turns, max_age_s):
        return None
    token = uuid.uuid4().hex
    lock = keys.turn_flush_lock(run)
    if not conn.set(lock, token, nx=True, px=LOCK_TTL_MS):
        return None  # another flusher is on it
    try:
        entries = conn.xrange(keys.turn_log(run), count=turns)
        if not entries:
            conn.eval(_FORGET_IF_EMPTY, 2, keys.turn_log(run), keys.TURN_RUNS, run)
            return None
        first_id = entries[0][0].decode()
        age = time.time() - int(first_id.split("-")[0]) / 1000
        if len(entries) < turns and age < max_age_s and not force:
            return None
        output = conn.get(keys.turn_log_output(run))
        if output is None:
            raise RuntimeError(f"run {run!r} has agent turns but no output URL ({keys.turn_log_output(run)})")
        table = _unify([turn_log_format.entry_rows(fields) for _, fields in entries])
        shard_id = f"turns-{first_id}"
        url = PendingShard.encode(table, output.decode(), run, shard_id).store()
        rows = table.num_rows
        commit = commit_log.Commit(
            job_id=shard_id, batch_id="turns", url=url, rows=rows,
            tokens=int(pc.sum(table.column("completion_tokens")).as_py() or 0),
            weight_version=int(pc.min(table.column("weight_version")).as_py()),
        )
        commit_log.append(conn, run, commit)
        with conn.pipeline(transaction=True) as pipe:
            pipe.xdel(keys.turn_log(run), *[entry_id for entry_id, _ in entries])
            turn_ids = {turn_log_format.entry_turn(fields) for _, fields in entries}
            pipe.hdel(keys.turn_log_jobs(run), *turn_ids)
            for turn in turn_ids:
                pipe.set(keys.turn_shard(turn), url, ex=TURN_SHARD_TTL_S)
            pipe.execute()
        log.info("run %s: %d turns (%d rows) written to %s", run, len(entries), rows, url)
        return url
    finally:
        conn.eval(_RELEASE, 1, lock, token)


class TurnFlusher:
    """A worker's thread that flushes every run's turn log (`flush_turns`) every `interval_s`."""

    def __init__(self, connect: Callable[[], redis.Redis], *, interval_s: float = FLUSH_CHECK_S,
                 turns: int = DEFAULT_SHARD_TURNS, max_age_s: float = DEFAULT_SHARD_AGE_S) -> None:
        self._connect = connect
        self.turns = turns
        self.max_age_s = max_age_s
        # A Redis or storage fault: the entries stay logged; the next tick tries again.
        self._thread = Periodic("turn-flusher", interval_s, self.flush_all, on_error=lambda exc: log.exception(
            "flushing agent turns failed; retrying in %.1f s", interval_s))

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush: bool = False) -> None:
        self._thread.stop(timeout_s=10)
        if flush:
            try:
                self.flush_all(force=True)
            except Exception:  # Redis or storage down at shutdown: the turns stay logged for another flusher
                log.exception("flushing agent turns at shutdown failed; they stay in the turn log")

    def flush_all(self, force: bool = False) -> int:
        """One pass over every run with a turn log; the number of shards written."""
        conn = self._connect()
        written = 0
        for run in conn.smembers(keys.TURN_RUNS):
            name = run.decode()
            while flush_turns(conn, name, turns=self.turns, max_age_s=self.max_age_s, force=force):
                written += 1
        return written
