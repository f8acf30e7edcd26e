"""Agent sessions as training sequences: one item per session from the rows of its turns.

`read_trajectories(RUN_OR_URL)` reads the rows of agent turns (`pipeline serve`: rows with a
`session_id`) and, per session, stitches its turns into one token sequence: the last turn's
prompt ids + its completion ids, where every earlier turn's prompt + completion is a prefix of
the next turn's prompt (the prefix rule made it so). Per item:

- `input_ids`: the episode's tokens;
- `loss_mask` (int8): 1 exactly on the tokens the model sampled in any turn, 0 on prompts, tool
  results and template glue. TRL calls this `env_mask` (a `rollout_func` returns it beside
  `completion_ids`), verl `response_mask`; it is the mask a policy-gradient loss sums over;
- `old_logprobs` (float32): the sampling engine's logprob of each sampled token, 0 elsewhere;
- `token_weight_version` (int64): the weight version that sampled each token, -1 elsewhere
  (a turn continued across a partial swap has several);
- `turn_starts`: where each turn's sampled tokens begin; `turns`: those turns' indices;
- `reward` and `rewards` (JSON): what `POST /sessions/<id>/reward` recorded (needs Redis);
- `segment`, `segments`: a session whose agent rewrote its history (a prefix break: a turn's
  prompt does not extend the previous turn's prompt + completion) comes back as several items,
  one per segment, each exact on its own; never one silently wrong sequence.

For `n > 1` a turn's sample continued by the next turn is the one whose tokens the next prompt
holds; the last turn gives its sample 0. A turn generated twice (a worker died after logging it
and its retry logged it again) counts once: its latest row.

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
from pipeline.core.errors import UnknownRunError
from pipeline.core.jobs import episodes, turn_log
from pipeline.core.shards import is_location, read_rollouts
from pipeline.core.suggest import did_you_mean, listing

_COLUMNS = ["session_id", "turn", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
            "weight_version", "weight_version_segments", "prefix_break", "finished_at", "worker_id",
            "prompt_tokens", "cached_tokens", "parent_turn", "parent_sample"]

TRAJECTORY_SCHEMA = pa.schema([
    pa.field("session_id", pa.string(), nullable=False),
    pa.field("segment", pa.int32(), nullable=False),
    pa.field("segments", pa.int32(), nullable=False),
    pa.field("turns", pa.list_(pa.int32()), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("old_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("token_weight_version", pa.list_(pa.int64()), nullable=False),
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
    selected = [t.select(_COLUMNS) for t in tables]
    table = pa.concat_tables(selected, promote_options="permissive")
    table = table.filter(pc.is_valid(table.column("session_id")))
    return _first_of_each_sample(table)


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


def _episodes(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A session's turns (one chosen sample each) split where a prompt stops extending the last."""
    by_turn: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for row in sorted(rows, key=lambda r: r["finished_at"]):  # a turn logged twice: the latest row wins
        by_turn[row["turn"]][row["sample_index"]] = row
    turns = sorted(by_turn)
    segments: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for position, turn in enumerate(turns):
        samples = by_turn[turn]
        chosen = samples[min(samples)]
        if position + 1 < len(turns):
            nxt = next(iter(by_turn[turns[position + 1]].values()))["prompt_token_ids"]
            chosen = next((s for _, s in sorted(samples.items())
                           if nxt[: len(s["prompt_token_ids"]) + len(s["completion_token_ids"])]
                           == s["prompt_token_ids"] + s["completion_token_ids"]), chosen)
        if current:
            before = current[-1]
            head = before["prompt_token_ids"] + before["completion_token_ids"]
            if chosen["prompt_token_ids"][: len(head)] != head:
                segments.append(current)
                current = []
        current.append(chosen)
    if current:
        segments.append(current)
    return segments


def _item(session_id: str, index: int, count: int, turns: list[dict[str, Any]],
          reward: dict[str, Any] | None) -> dict[str, Any]:
    last = turns[-1]
    ids = np.asarray(last["prompt_token_ids"] + last["completion_token_ids"], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.int8)
    logprobs = np.zeros(len(ids), dtype=np.float32)
    versions = np.full(len(ids), -1, dtype=np.int64)
    starts = []
    for row in turns:
        start, length = len(row["prompt_token_ids"]), len(row["completion_token_ids"])
        starts.append(start)
        mask[start:start + length] = 1
        if row["completion_logprobs"] is not None:
            logprobs[start:start + length] = row["completion_logprobs"]
        versions[start:start + length] = _versions(row)
    scalar = None if reward is None else reward.get("reward")
    return {"session_id": session_id, "segment": index, "segments": count, "turns": [r["turn"] for r in turns],
            "input_ids": ids, "loss_mask": mask, "old_logprobs": logprobs, "token_weight_version": versions,
            "turn_starts": starts, "reward": None if scalar is None else float(scalar),
            "rewards": None if reward is None else json.dumps(reward)}


def read_trajectories(source: str | pa.Table, *, conn: redis.Redis | None = None,
                      rewards: dict[str, dict[str, Any] | None] | None = None,
                      groups: bool = False) -> pa.Table | list[pa.Table]:
    """One row per session (per segment of a session with prefix breaks); see the module docstring.

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
    for row in table.select(_COLUMNS).to_pylist() if table.num_rows else []:
        sessions[row["session_id"]].append(row)
    if rewards is None and sessions and (conn is not None or not (isinstance(source, str) and is_location(source))):
        if conn is None and isinstance(source, str):
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        if conn is not None:
            rewards = session_rewards(conn, sorted(sessions))
    items = []
    for session_id in sorted(sessions):
        segments = _episodes(sessions[session_id])
        for index, turns in enumerate(segments):
            items.append(_item(session_id, index, len(segments), turns, (rewards or {}).get(session_id)))
    return pa.Table.from_pylist(items, schema=TRAJECTORY_SCHEMA)
