"""Training tokens of packed trees against the flattened lineages, on synthetic rows (issue 54).

A synthetic sub-agent harness, built as rows the server would log (no server, no engine: these are
**synthetic rows' figures**, token counts, not a measurement of anything running): per episode a
main agent of `--turns` calls under a system prompt and the task; after each main call 4 parallel
sub-agents, each a root of its own under one sub-agent system prompt, 3 calls each (completions,
tool results), whose answers come back to the main agent as tool results; and one compaction per
episode (after half the turns the main agent restarts from its system prompt, the task and a
summary). Lengths are drawn around realistic sizes (below); token ids are random, so only the
tokens the harness shares are shared.

Two layouts of the sub-agents:
- `own context` (the default harness): a sub-agent sees its system prompt and its task only;
- `forked`: a sub-agent continues the main agent's context (its first call extends the main call
  that spawned it, as a Claude-Code-style fork does).

Figures: lineages per episode; tokens a trainer computes on the flattened lineages (the sum of
their lengths: `read_trajectories` rows, one per lineage) against the packed tree of each episode
(`pipeline.read.trees.token_tree`: each shared token once) and the packed tree of each GRPO group
(the `--n` episodes of a task in one tree: their system prompts and task shared too); the ratio;
the loss tokens of the flattened lineages (sampled tokens, counted once per lineage holding them);
seconds to read the lineages and to build the trees.

    .venv/bin/python benchmarks/lineage_tokens.py [--episodes 200] [--n 8] [--turns 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa

import pipeline
from pipeline.read.trees import token_tree
from schemas.shard import SHARD_SCHEMA

VOCAB = 50_000
# Mean lengths in tokens (each draw is uniform in ±50 %).
MAIN_SYSTEM, SUB_SYSTEM, TASK, SUB_TASK = 800, 400, 200, 100
MAIN_COMPLETION, SUB_COMPLETION, TOOL_RESULT, SUB_ANSWER, SUMMARY = 150, 120, 300, 80, 400
SUB_CALLS, SUB_AGENTS = 3, 4
COLUMNS = ["session_id", "turn", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
           "weight_version", "weight_version_segments", "prefix_break", "parent_turn", "parent_sample", "finished_at",
           "worker_id", "prompt_tokens", "cached_tokens"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Episode:
    """The rows of one episode's session, call by call."""

    def __init__(self, session: str, rng: np.random.Generator) -> None:
        self.session, self.rng, self.rows = session, rng, []

    def ids(self, mean: int) -> list[int]:
        return self.rng.integers(1, VOCAB, size=int(self.rng.integers(mean // 2, mean * 3 // 2 + 1))).tolist()

    def call(self, prompt: list[int], completion_mean: int, parent: int | None) -> list[int]:
        """Log a call; its prompt + completion (what a child call extends)."""
        completion = self.ids(completion_mean)
        turn = len(self.rows)
        self.rows.append({"session_id": self.session, "turn": turn, "sample_index": 0, "prompt_token_ids": prompt,
                          "completion_token_ids": completion, "completion_logprobs": [-0.5] * len(completion),
                          "weight_version": 0, "weight_version_segments": None,
                          "prefix_break": parent is None and turn > 0, "parent_turn": parent,
                          "parent_sample": None if parent is None else 0,
                          "finished_at": T0 + timedelta(seconds=turn), "worker_id": "w",
                          "prompt_tokens": len(prompt), "cached_tokens": 0})
        return prompt + completion


def episode(session: str, main_system: list[int], sub_system: list[int], task: list[int], turns: int,
            forked: bool, rng: np.random.Generator) -> list[dict[str, Any]]:
    ep = Episode(session, rng)
    context = main_system + task
    parent = None
    for turn in range(turns):
        if turn == turns // 2:  # the compaction: a new root from the system prompt, the task and a summary
            context, parent = main_system + task + ep.ids(SUMMARY), None
        context = ep.call(context, MAIN_COMPLETION, parent)
        parent = len(ep.rows) - 1
        answers: list[int] = []
        for _ in range(SUB_AGENTS):
            sub, sub_parent = (context + ep.ids(SUB_TASK), parent) if forked else (sub_system + ep.ids(SUB_TASK), None)
            for _ in range(SUB_CALLS):
                sub = ep.call(sub, SUB_COMPLETION, sub_parent) + ep.ids(TOOL_RESULT)
                sub_parent = len(ep.rows) - 1
            answers += ep.ids(SUB_ANSWER)
        context = context + answers
    return ep.rows


def measure(args: argparse.Namespace, forked: bool) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    sub_system = rng.integers(1, VOCAB, size=SUB_SYSTEM).tolist()
    main_system = rng.integers(1, VOCAB, size=MAIN_SYSTEM).tolist()
    rows: list[dict[str, Any]] = []
    groups: list[list[str]] = []
    for task_index in range(-(-args.episodes // args.n)):
        task = rng.integers(1, VOCAB, size=TASK).tolist()
        sessions = [f"t{task_index}-{sample}" for sample in range(args.n)]
        groups.append(sessions)
        for session in sessions:
            rows += episode(session, main_system, sub_system, task, args.turns, forked, rng)
    table = pa.Table.from_pylist(rows, schema=pa.schema([SHARD_SCHEMA.field(name) for name in COLUMNS]))
    started = time.perf_counter()
    lineages = pipeline.read_trajectories(table, rewards={}).to_pylist()
    read_s = time.perf_counter() - started
    by_session: dict[str, list[dict[str, Any]]] = {}
    for item in lineages:
        by_session.setdefault(item["session_id"], []).append(item)
    started = time.perf_counter()
    episode_tokens = [token_tree(items).tokens for items in by_session.values()]
    tree_s = time.perf_counter() - started
    group_tokens = [token_tree([i for s in sessions for i in by_session[s]]).tokens for sessions in groups]
    flat = sum(len(item["input_ids"]) for item in lineages)
    return {"lineages": statistics.mean(len(v) for v in by_session.values()), "flat": flat,
            "episode": sum(episode_tokens), "group": sum(group_tokens),
            "sampled": sum(sum(item["loss_mask"]) for item in lineages), "calls": len(rows),
            "read_s": read_s, "tree_s": tree_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--n", type=int, default=8, help="episodes per task (a GRPO group)")
    parser.add_argument("--turns", type=int, default=6, help="main agent calls per episode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("synthetic rows' figures (benchmarks/lineage_tokens.py): token counts of a synthetic harness, "
          "not a measurement of a run")
    print(f"{args.episodes} episodes, {args.n} per task, {args.turns} main calls each, {SUB_AGENTS} sub-agents "
          f"of {SUB_CALLS} calls per main call, one compaction per episode")
    print(f"{'sub-agents':>12} {'lineages/ep':>11} {'flattened':>11} {'tree/episode':>13} {'ratio':>6} "
          f"{'tree/group':>11} {'ratio':>6} {'loss tokens':>11} {'read s':>7} {'tree s':>7}")
    for name, forked in (("own context", False), ("forked", True)):
        m = measure(args, forked)
        print(f"{name:>12} {m['lineages']:>11.1f} {m['flat']:>11,} {m['episode']:>13,} "
              f"{m['flat'] / m['episode']:>5.2f}x {m['group']:>11,} {m['flat'] / m['group']:>5.2f}x "
              f"{m['sampled']:>11,} {m['read_s']:>7.1f} {m['tree_s']:>7.1f}")


if __name__ == "__main__":
    main()
