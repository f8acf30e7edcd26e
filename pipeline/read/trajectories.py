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
(`pipeline.read.lineage_rows.turn_rows` gives a run's raw turn rows the same way).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import redis

from pipeline.core.jobs import episodes
from pipeline.core.shards import is_location
from pipeline.read.episodes import episode_groups, episode_trajectories
from pipeline.read.lineage_rows import lineage_table, session_rewards, turn_rows


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
        return list(episode_groups(source, conn=conn))
    if isinstance(source, str) and not is_location(source):
        if conn is None:
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        if episodes.is_episode_run(conn, source):
            return episode_trajectories(source, conn=conn)
    table = source if isinstance(source, pa.Table) else turn_rows(source, conn)
    if isinstance(source, pa.Table) and "session_id" in table.column_names:
        table = table.filter(pc.is_valid(table.column("session_id")))
    a_url = isinstance(source, str) and is_location(source)
    if rewards is None and table.num_rows and (conn is not None or not a_url):
        if conn is None and isinstance(source, str):
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
        if conn is not None:
            rewards = session_rewards(conn, sorted(set(table.column("session_id").to_pylist())))
    return lineage_table(table, rewards or {})
