"""Agent sessions as training sequences: one item per lineage from the rows of its calls.

`read_trajectories(RUN_OR_URL)` reads the rows of agent turns (`pipeline serve`: rows with a
`session_id`) and, per lineage of a session (a root-to-leaf path of its tree of calls), stitches
its calls into one token sequence: the leaf call's prompt ids + its completion ids, where every
earlier call's prompt + completion is a prefix of the next call's prompt (the server placed each
call under the call it extends). Per item:

- `input_ids`: the lineage's tokens;
- `loss_mask` (int8): 1 exactly on the tokens the model sampled in the lineage's calls, 0 on prompts, tool
  results and template glue. TRL calls this `env_mask` (a `rollout_func` returns it beside
  `completion_ids`), verl `response_mask`; it is the mask a policy-gradient loss sums over;
- `old_logprobs` (float32): the sampling engine's logprob of each sampled token, 0 elsewhere;
- `token_weight_version` (int64): the weight version that sampled each token, -1 elsewhere
  (a turn continued across a partial swap has several);
- `adapter`: the LoRA adapter the lineage's calls ran on (null: the base weights; a session names
  one for all its calls, `docs/adapters.md`); `token_adapter_version` (int64): the version of it that
  sampled each token, -1 elsewhere and on the base (each call runs on the version current when its
  job started, so a lineage may span several);
- `turn_starts`: where each turn's sampled tokens begin; `turns`: those turns' indices;
- `reward` and `rewards` (JSON): what `POST /sessions/<id>/reward` recorded (needs Redis): the
  session's reward applies to each of its lineages, unless the dict holds `"lineage_rewards":
  {CALL_ID: x, ...}`, keyed by a lineage's leaf call (the `id` the agent got back, `chatcmpl-...` or
  `cmpl-...`, or the bare turn id): that lineage gets x;
- `lineage`, `lineages`: a session is a tree of calls (sub-agents, parallel calls, compaction, a
  rewritten history each start or fork a branch; `pipeline.read.call_tree`); each root-to-leaf path
  is one item, each exact on its own, ordered by its leaf call's turn; `parent_turn`: the call its
  first call not on an earlier lineage extends (null when it starts at a root of its own). A
  harness with one linear conversation gets one item per run of turns between prefix breaks.

For `n > 1` a call's sample on a lineage is the one its child names (the server records it); a
leaf gives its sample 0. A turn generated twice (a worker died after logging it and its retry
logged it again) counts once: its latest row.

With a run name (read through Redis), turns not yet written to a shard are read from the run's
turn log too, so an episode is complete as soon as its last turn is answered.

A run of agent episodes (`pipeline submit --agent`) read by name gives its episodes that reach
training, and only those (`pipeline.read.episodes.episode_trajectories`, by the rule of
`pipeline.core.jobs.episodes.trained`): never a retried, abandoned, duplicate or canceled attempt's
session. A URL or a Table of rows has no outcomes to go by: every session served comes back
(`turn_rows` gives a run's raw turn rows the same way).
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
from pipeline.core.jobs import episodes, turn_log
from pipeline.core.shards import is_location, read_rollouts
from pipeline.core.suggest import did_you_mean, listing
from pipeline.read.call_tree import Lineage, lineages
from schemas.turn_id import TurnId

_COLUMNS = ["session_id", "turn", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
            "weight_version", "weight_version_segments", "prefix_break", "parent_turn", "parent_sample",
            "finished_at", "worker_id", "prompt_tokens", "cached_tokens", "adapter", "adapter_version"]
# Rows written before a session was a tree of calls have no parent pointers (every call a root), and
# rows written before adapters no adapter columns (the base weights).
_LATER_COLUMNS = {"parent_turn": pa.int32(), "parent_sample": pa.int32(), "adapter": pa.string(),
                  "adapter_version": pa.int64()}
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


def _versions(row: dict[str, Any]) -> np.ndarray:
    length = len(row["completion_token_ids"])
    out = np.full(length, row["weight_version"], dtype=np.int64)
    for segment in row["weight_version_segments"] or []:
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
    adapter = _adapter(session_id, turns)
    starts = []
    for row in turns:
        start, length = len(row["prompt_token_ids"]), len(row["completion_token_ids"])
        starts.append(start)
        mask[start:start + length] = 1
        if row["completion_logprobs"] is not None:
            logprobs[start:start + length] = row["completion_logprobs"]
        versions[start:start + length] = _versions(row)
        if row["adapter_version"] is not None:
            adapter_versions[start:start + length] = row["adapter_version"]
    scalar = own.get(last["turn"], None if reward is None else reward.get("reward"))
    return {"session_id": session_id, "lineage": index, "lineages": count, "parent_turn": lineage.parent_turn,
            "turns": [r["turn"] for r in turns], "input_ids": ids, "loss_mask": mask, "old_logprobs": logprobs,
            "token_weight_version": versions, "adapter": adapter, "token_adapter_version": adapter_versions,
            "turn_starts": starts, "reward": None if scalar is None else float(scalar),
            "rewards": None if reward is None else json.dumps(reward)}


def _adapter(session_id: str, calls: list[dict[str, Any]]) -> str | None:
    """The one adapter a lineage's calls ran on (a session names one for all its calls)."""
    names = {row["adapter"] for row in calls}
    if len(names) > 1:
        raise PipelineError(f"session {session_id!r}: the calls {[r['turn'] for r in calls]} of one lineage ran on "
                            f"different adapters ({sorted(names, key=str)}); a lineage trains one policy, so a "
                            "harness gives each adapter its own session")
    return names.pop()


def session_items(session_id: str, rows: list[dict[str, Any]], reward: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A session's items, one per lineage (see the module docstring), from its rows."""
    found = lineages(session_id, rows)
    own = lineage_rewards(session_id, reward, [lin.leaf["turn"] for lin in found])
    return [_item(session_id, index, len(found), lin, reward, own) for index, lin in enumerate(found)]


def read_trajectories(source: str | pa.Table, *, conn: redis.Redis | None = None,
                      rewards: dict[str, dict[str, Any] | None] | None = None,
                      groups: bool = False) -> pa.Table | list[pa.Table]:
    """One row per lineage of each session; see the module docstring.

    `source` is a run name (read through Redis: `conn`, else the default connection), a URL of
    shards, or a Table of rows. Rewards come from `rewards` (session id → {"reward": x, ...}),
    else from Redis when there is a connection.

    A run of agent episodes (`pipeline submit --agent`) by name: its episodes that reach training only
    (`pipeline.read.episodes.episode_trajectories`, with their task ids, statuses and rewards);
    `groups=True`: the same, one table per task holding its n episodes, for the tasks whose episodes
    have all ended (`pipeline.read.episodes.episode_groups`, which also follows a run as its groups end).
    """
    if groups:
        if not isinstance(source, str):
            raise TypeError("groups=True reads a run of agent episodes by name")
        from pipeline.read.episodes import episode_groups

        return list(episode_groups(source, conn=conn))
    if isinstance(source, str) and not is_location(source):
        if conn is None:
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        if episodes.is_episode_run(conn, source):
            from pipeline.read.episodes import episode_trajectories

            return episode_trajectories(source, conn=conn)
    table = source if isinstance(source, pa.Table) else turn_rows(source, conn)
    if isinstance(source, pa.Table) and "session_id" in table.column_names:
        table = table.filter(pc.is_valid(table.column("session_id")))
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _select(table).to_pylist() if table.num_rows else []:
        sessions[row["session_id"]].append(row)
    if rewards is None and sessions and (conn is not None or not (isinstance(source, str) and is_location(source))):
        if conn is None and isinstance(source, str):
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        if conn is not None:
            rewards = session_rewards(conn, sorted(sessions))
    items = [item for session_id in sorted(sessions)
             for item in session_items(session_id, sessions[session_id], (rewards or {}).get(session_id))]
    return pa.Table.from_pylist(items, schema=TRAJECTORY_SCHEMA)
