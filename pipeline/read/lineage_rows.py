"""Rows of agent turns as lineages: the layer under `pipeline.read.trajectories` and the episode readers.

`turn_rows(run_or_url)` reads a run's turn rows (its shards and its unflushed turn log) or a URL's;
`lineage_table(rows, rewards)` stitches each session's rows into one item per lineage, as
`pipeline.read.trajectories` describes them (its docstring lists the columns), `TRAJECTORY_SCHEMA`;
`lineage_rewards` and `own_reward` read the rewards a session or an agent gave its lineages.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import redis

from pipeline.core.broker import keys, registry
from pipeline.core.errors import PipelineError, UnknownRunError
from pipeline.core.jobs import turn_log
from pipeline.core.shards import is_location, read_rollouts
from pipeline.core.suggest import did_you_mean, listing
from pipeline.read.call_tree import Lineage, lineages
from schemas.shard import VERSION_SEGMENT, values_of
from schemas.turn_id import TurnId

_COLUMNS = ["session_id", "turn", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
            "weight_version", "weight_version_segments", "prefix_break", "parent_turn", "parent_sample",
            "finished_at", "worker_id", "prompt_tokens", "cached_tokens", "adapter", "adapter_version",
            "adapter_version_segments"]
# Rows written before a session was a tree of calls have no parent pointers (every call a root), and
# rows written before adapters no adapter columns (the base weights).
_LATER_COLUMNS = {"parent_turn": pa.int32(), "parent_sample": pa.int32(), "adapter": pa.string(),
                  "adapter_version": pa.int64(),
                  "adapter_version_segments": values_of(VERSION_SEGMENT)}
CALL_ID_PREFIXES = ("chatcmpl-", "cmpl-")

TRAJECTORY_SCHEMA = pa.schema([
    pa.field("session_id", pa.string(), nullable=False),
    pa.field("lineage", pa.int32(), nullable=False),
    pa.field("lineages", pa.int32(), nullable=False),
    pa.field("parent_turn", pa.int32()),
    pa.field("turns", pa.list_(pa.int32()), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("old_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("token_weight_version", pa.list_(pa.int64()), nullable=False),
    pa.field("adapter", pa.string()),
    pa.field("token_adapter_version", pa.list_(pa.int64()), nullable=False),
    pa.field("turn_starts", pa.list_(pa.int32()), nullable=False),
    pa.field("reward", pa.float64()),
    pa.field("rewards", pa.string()),
])


def session_rewards(conn: redis.Redis, session_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """Each session's recorded reward (None when none, or the session expired)."""
    with conn.pipeline(transaction=False) as pipe:
        for session_id in session_ids:
            pipe.hget(keys.session(session_id), "reward")
        values = pipe.execute()
    return {s: (json.loads(v) if v else None) for s, v in zip(session_ids, values, strict=True)}


def _check_run(conn: redis.Redis, run: str) -> None:
    """Refuse a run this Redis never had (a typo, another Redis) instead of reading it as empty."""
    if conn.exists(keys.run_batches(run), keys.commit_log(run), keys.turn_log(run), keys.turn_log_output(run)):
        return
    known = registry.runs(conn)
    if run not in known:
        raise UnknownRunError(f"run {run!r} has no agent turns or jobs in this Redis; runs here: {listing(known)}"
                              f"{did_you_mean(run, known)}; check the run name and the Redis URL")


def turn_rows(source: str, conn: redis.Redis | None = None) -> pa.Table:
    """The rows of agent turns under a URL, or of a run (shards through its commit log, plus its turn log)."""
    if is_location(source):
        table = read_rollouts(source, missing_ok=True)
        tables = [table] if "session_id" in table.column_names else []
    else:
        if conn is None:
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        _check_run(conn, source)
        # The log first, then the shards: a flush between the two reads moves turns from the log to
        # a shard, and this order sees them (twice, deduplicated below) rather than not at all.
        logged = turn_log.unflushed(conn, source)
        tables = [read_rollouts([], run=source, conn=conn, missing_ok=True), *logged]
        tables = [t for t in tables if "session_id" in t.column_names]
    if not tables:
        return pa.table({name: pa.array([], pa.null()) for name in _COLUMNS})
    table = pa.concat_tables([_select(t) for t in tables], promote_options="permissive")
    table = table.filter(pc.is_valid(table.column("session_id")))
    return _first_of_each_sample(table)


def _select(table: pa.Table) -> pa.Table:
    """The columns stitching reads, nulls where the rows predate a column."""
    for name, kind in _LATER_COLUMNS.items():
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, kind))
    return table.select(_COLUMNS)


def _first_of_each_sample(table: pa.Table) -> pa.Table:
    """Each generated row once: a turn read from both the log and its new shard is the same row
    (same session, turn, sample and finish time); a turn generated again is not."""
    keys_seen = table.select(["session_id", "turn", "sample_index", "finished_at"]).to_pylist()
    seen: set[tuple[Any, ...]] = set()
    keep = []
    for i, row in enumerate(keys_seen):
        key = (row["session_id"], row["turn"], row["sample_index"], row["finished_at"])
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return table if len(keep) == table.num_rows else table.take(keep)


def _versions(row: dict[str, Any], scalar: str = "weight_version") -> np.ndarray:
    """Each completion token's version: `scalar`'s, or per segment (`<scalar>_segments`)."""
    length = len(row["completion_token_ids"])
    out = np.full(length, row[scalar], dtype=np.int64)
    for segment in row[f"{scalar}_segments"] or []:
        out[segment["start"]:] = segment["version"]
    return out


def _call_turn(session_id: str, key: str) -> int:
    """The turn a `lineage_rewards` key names: a call id (`chatcmpl-<turn id>`, `cmpl-<turn id>`) or a turn id."""
    text = next((key[len(p):] for p in CALL_ID_PREFIXES if key.startswith(p)), key)
    try:
        turn_id = TurnId.parse(text)
    except ValueError as error:
        raise PipelineError(f"session {session_id!r}: lineage_rewards key {key!r} is not a call id; key each lineage's "
                            "reward by the `id` its last call returned (chatcmpl-... or cmpl-...)") from error
    if turn_id.session_id != session_id:
        raise PipelineError(f"session {session_id!r}: lineage_rewards key {key!r} names a call of session "
                            f"{turn_id.session_id!r}; record each session's rewards on that session")
    return turn_id.turn


def _given(session_id: str, reward: dict[str, Any] | None) -> dict[int, float]:
    return {_call_turn(session_id, key): float(value)
            for key, value in ((reward or {}).get("lineage_rewards") or {}).items()}


def lineage_rewards(session_id: str, reward: dict[str, Any] | None, leaves: list[int]) -> dict[int, float]:
    """The rewards a reward dict gives a session's lineages one by one (`"lineage_rewards"`), by leaf turn;
    a key naming a call that ends no lineage (`leaves`) is an error."""
    own = _given(session_id, reward)
    unknown = sorted(set(own) - set(leaves))
    if unknown:
        raise PipelineError(f"session {session_id!r}: lineage_rewards names calls {unknown}, which end no lineage (the "
                            f"lineages end at calls {leaves}); key a lineage's reward by the id of its last call")
    return own


def own_reward(item: dict[str, Any]) -> float | None:
    """The reward an item's session recorded for its lineage alone (`"lineage_rewards"`), None when none."""
    if not item["turns"] or not item["rewards"]:
        return None
    return _given(item["session_id"], json.loads(item["rewards"])).get(item["turns"][-1])


def _item(session_id: str, index: int, count: int, lineage: Lineage, reward: dict[str, Any] | None,
          own: dict[int, float]) -> dict[str, Any]:
    turns = lineage.calls
    last = lineage.leaf
    ids = np.asarray(last["prompt_token_ids"] + last["completion_token_ids"], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.int8)
    logprobs = np.zeros(len(ids), dtype=np.float32)
    versions = np.full(len(ids), -1, dtype=np.int64)
    adapter_versions = np.full(len(ids), -1, dtype=np.int64)
    starts = []
    for row in turns:
        start, length = len(row["prompt_token_ids"]), len(row["completion_token_ids"])
        starts.append(start)
        mask[start:start + length] = 1
        if row["completion_logprobs"] is not None:
            logprobs[start:start + length] = row["completion_logprobs"]
        versions[start:start + length] = _versions(row)
        if row["adapter_version"] is not None:
            adapter_versions[start:start + length] = _versions(row, "adapter_version")
    scalar = own.get(last["turn"], None if reward is None else reward.get("reward"))
    return {"session_id": session_id, "lineage": index, "lineages": count, "parent_turn": lineage.parent_turn,
            "turns": [r["turn"] for r in turns], "input_ids": ids, "loss_mask": mask, "old_logprobs": logprobs,
            "token_weight_version": versions, "adapter": lineage.adapter, "token_adapter_version": adapter_versions,
            "turn_starts": starts, "reward": None if scalar is None else float(scalar),
            "rewards": None if reward is None else json.dumps(reward)}


def session_items(session_id: str, rows: list[dict[str, Any]], reward: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A session's items, one per lineage (see the module docstring), from its rows."""
    found = lineages(session_id, rows)
    own = lineage_rewards(session_id, reward, [lin.leaf["turn"] for lin in found])
    return [_item(session_id, index, len(found), lin, reward, own) for index, lin in enumerate(found)]


def lineage_table(table: pa.Table, rewards: dict[str, dict[str, Any] | None]) -> pa.Table:
    """One row per lineage of each session of `table` (rows of agent turns, a `session_id` each), its
    session's reward from `rewards` (session id -> the recorded dict)."""
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _select(table).to_pylist() if table.num_rows else []:
        sessions[row["session_id"]].append(row)
    items = [item for session_id in sorted(sessions)
             for item in session_items(session_id, sessions[session_id], rewards.get(session_id))]
    return pa.Table.from_pylist(items, schema=TRAJECTORY_SCHEMA)
