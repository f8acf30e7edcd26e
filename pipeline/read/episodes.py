"""Agent episodes into training: the lineages of each task × sample, grouped by task for GRPO.

`episode_trajectories(run)` (what `read_trajectories(run)` returns for a run of episodes) is the
run's sessions cut to the attempts that reach training, by the one rule of
`pipeline.core.jobs.episodes.trained`: an attempt that was retried, abandoned by a worker that died,
or run twice left a session whose turns never reach training; failed episodes are left out unless
the run was submitted with `failed_reward` (`--failed-reward 0`: then they come with that reward, and
an empty sequence when they never reached the model); a task with a canceled episode (`pipeline
cancel`, `EpisodeRun.take`) is left out whole, even its episodes that finished. An episode is one
row per lineage of its session (`pipeline.read.trajectories`: sub-agents, compaction and rewritten
history make several), each with its task id, sample, status, attempts, trace id and reward: the
outcome's, unless the agent gave the lineage its own: `"lineage_rewards": {CALL_ID: x}` in the dict
it returned (kept in `info`), else in the reward recorded on its session.

`episode_groups(run)` yields a task's n episodes (all their lineages) together once all n are
finished, failed or canceled, in task order (a group left with no episode is not yielded); with
`follow=True` it waits for the groups still running. `keep` filters groups
(`pipeline.rewards_differ`: DAPO's, drops groups whose rewards are all equal).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis

from pipeline.core.broker import keys, registry
from pipeline.core.errors import UnknownRunError, WaitTimeoutError
from pipeline.core.jobs import episodes
from pipeline.core.suggest import did_you_mean, listing
from pipeline.read.lineage_rows import (
    TRAJECTORY_SCHEMA,
    lineage_rewards,
    lineage_table,
    own_reward,
    session_rewards,
    turn_rows,
)
from schemas.episode import EpisodeOutcome

EPISODE_FIELDS = [
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("sample", pa.int32(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("reason", pa.string()),
    pa.field("attempts", pa.int32(), nullable=False),
    pa.field("episode_turns", pa.int32(), nullable=False),
    pa.field("trace_id", pa.string(), nullable=False),
    pa.field("info", pa.string()),
]
EPISODE_SCHEMA = pa.schema([*EPISODE_FIELDS, *TRAJECTORY_SCHEMA])
POLL_S = 0.2


def _connection(conn: redis.Redis | None) -> redis.Redis:
    if conn is not None:
        return conn
    from pipeline.core.broker.connection import connect_redis

    return connect_redis()


def _spec(conn: redis.Redis, run: str) -> dict[str, Any]:
    info = episodes.run_info(conn, run)
    if info is None:
        known = sorted(m.decode() for m in conn.smembers(keys.EPISODE_RUNS)) or registry.runs(conn)
        raise UnknownRunError(f"run {run!r} has no agent episodes in this Redis; runs with episodes: {listing(known)}"
                              f"{did_you_mean(run, known)}; submit with `pipeline submit TASKS --agent ...`")
    return info


def _empty_item(outcome: EpisodeOutcome) -> dict[str, Any]:
    return {"session_id": outcome.session_id or "", "lineage": 0, "lineages": 1, "parent_turn": None, "turns": [],
            "input_ids": [], "loss_mask": [], "old_logprobs": [], "token_weight_version": [], "adapter": None,
            "token_adapter_version": [], "turn_starts": [],
            "rewards": None}


def _returned_rewards(outcome: EpisodeOutcome, items: list[dict[str, Any]]) -> dict[int, float]:
    """The rewards per lineage the agent returned beside its reward (`"lineage_rewards"`), by leaf turn."""
    given = (outcome.info or {}).get("lineage_rewards")
    if outcome.status != "finished" or not given:
        return {}
    return lineage_rewards(outcome.session_id or "", {"lineage_rewards": given},
                           [item["turns"][-1] for item in items if item["turns"]])


def _rows(outcomes: list[EpisodeOutcome], items: dict[str, list[dict[str, Any]]],
          failed_reward: float | None) -> list[dict[str, Any]]:
    rows = []
    for outcome in episodes.trained(outcomes, failed_reward):
        reward = outcome.reward if outcome.status == "finished" else failed_reward
        base = {"task_id": outcome.task_id, "sample": outcome.sample, "status": outcome.status,
                "reason": outcome.reason, "attempts": outcome.attempts, "episode_turns": outcome.turns,
                "trace_id": outcome.trace_id, "info": json.dumps(outcome.info) if outcome.info else None}
        episode_items = items.get(outcome.session_id or "", []) or [_empty_item(outcome)]
        returned = _returned_rewards(outcome, episode_items)
        for item in episode_items:
            own = returned.get(item["turns"][-1]) if item["turns"] else None
            if own is None and outcome.status == "finished":
                own = own_reward(item)
            rows.append({**base, **item, "reward": reward if own is None else own})
    return rows


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=EPISODE_SCHEMA)


def _trajectories(conn: redis.Redis, run: str, outcomes: list[EpisodeOutcome],
                  failed_reward: float | None) -> dict[str, list[dict[str, Any]]]:
    """The trajectories of the sessions the rule (`episodes.trained`) keeps, by session; no other is stitched."""
    wanted = sorted({o.session_id for o in episodes.trained(outcomes, failed_reward) if o.session_id})
    if not wanted:
        return {}
    rows = turn_rows(run, conn)
    if not rows.num_rows:
        return {}
    rows = rows.filter(pc.is_in(rows.column("session_id"), pa.array(wanted, pa.string())))
    items: dict[str, list[dict[str, Any]]] = {}
    for item in lineage_table(rows, session_rewards(conn, wanted)).to_pylist():
        items.setdefault(item["session_id"], []).append(item)
    return items


def episode_trajectories(run: str, *, conn: redis.Redis | None = None) -> pa.Table:
    """Every episode of `run` that reaches training with its trajectory (see the module docstring), in task
    order."""
    conn = _connection(conn)
    spec = _spec(conn, run)
    order = {task: i for i, task in enumerate(spec["tasks"])}
    outcomes = sorted(episodes.outcomes(conn, run).values(), key=lambda o: (order.get(o.task_id, 1 << 30), o.sample))
    failed_reward = spec.get("failed_reward")
    return _table(_rows(outcomes, _trajectories(conn, run, outcomes, failed_reward), failed_reward))


def episode_groups(run: str, *, conn: redis.Redis | None = None, follow: bool = False,
                   timeout: float | None = None, keep: Callable[[pa.Table], bool] | None = None) -> Iterator[pa.Table]:
    """Each task's n episodes as one table, once all n have an outcome, in task order (see the module
    docstring); `follow`: wait for the groups still running (`timeout`: `WaitTimeoutError` past it)."""
    conn = _connection(conn)
    yielded: set[str] = set()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        spec = _spec(conn, run)  # read each round: a later submit into the run adds tasks
        n = int(spec["n"])
        by_task: dict[str, list[EpisodeOutcome]] = {}
        for outcome in episodes.outcomes(conn, run).values():
            by_task.setdefault(outcome.task_id, []).append(outcome)
        ready = [t for t in spec["tasks"] if t not in yielded and len(by_task.get(t, [])) >= n]
        if ready:
            outcomes = [o for t in ready for o in sorted(by_task[t], key=lambda o: o.sample)]
            items = _trajectories(conn, run, outcomes, spec.get("failed_reward"))
            for task in ready:
                yielded.add(task)
                group = _table(_rows(sorted(by_task[task], key=lambda o: o.sample), items, spec.get("failed_reward")))
                if group.num_rows and (keep is None or keep(group)):
                    yield group
        if not follow or len(yielded) == len(spec["tasks"]):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise WaitTimeoutError(f"run {run!r}: {len(spec['tasks']) - len(yielded)} of {len(spec['tasks'])} "
                                   f"task groups not finished after {timeout:g} s (are agent workers running? "
                                   "`pipeline status`)")
        if not ready:
            time.sleep(POLL_S)
