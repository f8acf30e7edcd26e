"""`read_trajectories` on a session that is a tree of calls: one row per lineage (a root-to-leaf path
of calls, built from the server's parent pointers), each exact; a linear harness gets what it got when
a session was one conversation; rewards per lineage; a pointer the tokens contradict is an error."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest

import pipeline
from pipeline.core.errors import PipelineError
from schemas.shard import SHARD_SCHEMA
from schemas.turn_id import TurnId

T0 = datetime(2026, 1, 1, tzinfo=UTC)
COLUMNS = ["session_id", "turn", "sample_index", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
           "weight_version", "weight_version_segments", "prefix_break", "parent_turn", "parent_sample",
           "finished_at", "worker_id", "prompt_tokens", "cached_tokens"]


def call(turn: int, prompt: list[int], completion: list[int], *, parent: tuple[int, int] | None = None,
         sample: int = 0, session: str = "s", finished: int = 0) -> dict[str, Any]:
    """One row of an agent turn as the server logs it: logprob -(turn + 1) / 10 on each sampled token."""
    return {"session_id": session, "turn": turn, "sample_index": sample, "prompt_token_ids": prompt,
            "completion_token_ids": completion, "completion_logprobs": [-(turn + 1) / 10] * len(completion),
            "weight_version": 0, "weight_version_segments": None, "prefix_break": parent is None and turn > 0,
            "parent_turn": None if parent is None else parent[0],
            "parent_sample": None if parent is None else parent[1],
            "finished_at": T0 + timedelta(seconds=turn + finished), "worker_id": "w",
            "prompt_tokens": len(prompt), "cached_tokens": 0}


def table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema([SHARD_SCHEMA.field(name) for name in COLUMNS]))


def read(rows: list[dict[str, Any]], rewards: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return pipeline.read_trajectories(table(rows), rewards=rewards or {}).to_pylist()


def sampled(item: dict[str, Any]) -> list[int]:
    return [i for i, m in enumerate(item["loss_mask"]) if m]


def linear_conversation() -> list[dict[str, Any]]:
    """Turns 0-1 one conversation, turn 2 a rewritten history (a prefix break), turn 3 extending it;
    turn 0 has n=2 and turn 1 continues its sample 1."""
    return [call(0, [1, 2], [3, 4], sample=0), call(0, [1, 2], [5, 6], sample=1),
            call(1, [1, 2, 5, 6, 7], [8], parent=(0, 1)),
            call(2, [9], [10, 11]), call(3, [9, 10, 11, 12], [13], parent=(2, 0))]


def test_a_linear_conversation_reads_as_its_runs_between_prefix_breaks() -> None:
    first, second = read(linear_conversation())
    assert (first["lineage"], first["lineages"], first["turns"], first["parent_turn"]) == (0, 2, [0, 1], None)
    assert first["input_ids"] == [1, 2, 5, 6, 7, 8]  # turn 0's sample 1: the one turn 1 continued
    assert first["loss_mask"] == [0, 0, 1, 1, 0, 1] and first["turn_starts"] == [2, 5]
    assert first["old_logprobs"] == pytest.approx([0, 0, -0.1, -0.1, 0, -0.2])
    assert first["token_weight_version"] == [-1, -1, 0, 0, -1, 0]
    assert (second["lineage"], second["turns"], second["parent_turn"]) == (1, [2, 3], None)
    assert second["input_ids"] == [9, 10, 11, 12, 13] and sampled(second) == [1, 2, 4]


def test_rows_without_parent_pointers_read_each_call_as_a_root() -> None:
    rows = [{k: v for k, v in r.items() if k not in ("parent_turn", "parent_sample")} for r in linear_conversation()]
    schema = pa.schema([SHARD_SCHEMA.field(name) for name in COLUMNS if name not in ("parent_turn", "parent_sample")])
    items = pipeline.read_trajectories(pa.Table.from_pylist(rows, schema=schema), rewards={}).to_pylist()
    assert [i["turns"] for i in items] == [[0], [1], [2], [3]]


def sub_agent_session() -> list[dict[str, Any]]:
    """A main agent (turns 0, 3, 4) that calls two sub-agents in parallel (turns 1 and 2, roots of their
    own, then 5 extending 1), and a fork: turn 6 extends main turn 3 beside turn 4."""
    return [call(0, [1, 2], [3]),
            call(1, [1, 50], [51]), call(2, [1, 60], [61]),
            call(3, [1, 2, 3, 4], [5], parent=(0, 0)),
            call(4, [1, 2, 3, 4, 5, 6], [7], parent=(3, 0)),
            call(5, [1, 50, 51, 52], [53], parent=(1, 0)),
            call(6, [1, 2, 3, 4, 5, 8], [9, 10], parent=(3, 0))]


def test_a_tree_of_calls_is_one_row_per_root_to_leaf_path_in_leaf_order() -> None:
    items = read(sub_agent_session())
    assert [(i["lineage"], i["turns"], i["parent_turn"]) for i in items] == [
        (0, [2], None), (1, [0, 3, 4], None), (2, [1, 5], None), (3, [0, 3, 6], 3)]
    assert all(i["lineages"] == 4 for i in items)
    fork = items[3]
    assert fork["input_ids"] == [1, 2, 3, 4, 5, 8, 9, 10]
    assert sampled(fork) == [2, 4, 6, 7]  # turns 0, 3 and 6 sampled these; nothing of the sibling turn 4
    assert fork["old_logprobs"] == pytest.approx([0, 0, -0.1, 0, -0.4, 0, -0.7, -0.7])
    assert fork["turn_starts"] == [2, 4, 6]


def test_a_turn_logged_twice_counts_once_its_latest_row() -> None:
    rows = [*sub_agent_session(), call(2, [1, 60], [62, 63], finished=1)]  # turn 2 retried, logged again
    (only,) = [i for i in read(rows) if i["turns"] == [2]]
    assert only["input_ids"] == [1, 60, 62, 63]


def test_a_pointer_the_tokens_contradict_is_an_error_naming_the_calls() -> None:
    rows = [call(0, [1, 2], [3]), call(1, [1, 2, 4, 5], [6], parent=(0, 0))]
    with pytest.raises(PipelineError, match=r"session 's': call 1's prompt does not start with .* call 0 sample 0"):
        read(rows)
    with pytest.raises(PipelineError, match=r"session 's': call 1 names call 0 sample 1 .* no rows"):
        read([call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], [6], parent=(0, 1))])


def test_the_session_reward_applies_to_each_lineage_unless_it_gives_one_its_own() -> None:
    leaf = str(TurnId("s", 5, "abcdef"))
    reward = {"reward": 1.0, "lineage_rewards": {f"chatcmpl-{leaf}": 0.25, str(TurnId("s", 2, "012345")): -1}}
    items = read(sub_agent_session(), rewards={"s": reward})
    assert [(i["turns"][-1], i["reward"]) for i in items] == [(2, -1.0), (4, 1.0), (5, 0.25), (6, 1.0)]
    assert all(json.loads(i["rewards"]) == reward for i in items)
    wrong = {"lineage_rewards": {f"cmpl-{TurnId('s', 3, 'abcdef')}": 1.0}}
    with pytest.raises(PipelineError, match=r"names calls \[3\], which end no lineage .* \[2, 4, 5, 6\]"):
        read(sub_agent_session(), rewards={"s": wrong})
    with pytest.raises(PipelineError, match=r"names a call of session 'other'"):
        read(sub_agent_session(), rewards={"s": {"lineage_rewards": {str(TurnId("other", 2, "abcdef")): 1.0}}})
    with pytest.raises(PipelineError, match=r"'chatcmpl-x' is not a call id"):
        read(sub_agent_session(), rewards={"s": {"lineage_rewards": {"chatcmpl-x": 1.0}}})


def test_rollout_batches_give_a_padded_row_per_lineage() -> None:
    from pipeline.read.torch_data import RolloutBatches

    items = read(sub_agent_session())
    (batch,) = list(RolloutBatches(table(sub_agent_session()), trajectories=True, batch_size=8, pad_id=0))
    assert batch["session_id"] == ["s"] * 4 and batch["lineage"] == [0, 1, 2, 3]
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == item["input_ids"]
        assert batch["attention_mask"][row].sum().item() == n
        assert batch["loss_mask"][row].tolist() == item["loss_mask"] + [0] * (batch["loss_mask"].shape[1] - n)


def on_adapter(row: dict[str, Any], adapter: str | None, version: int | None,
               segments: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    return {**row, "adapter": adapter, "adapter_version": version,
            "adapter_version_segments": None if segments is None else [{"start": a, "version": v} for a, v in segments]}


def adapter_table(rows: list[dict[str, Any]]) -> pa.Table:
    names = [*COLUMNS, "adapter", "adapter_version", "adapter_version_segments"]
    return pa.Table.from_pylist(rows, schema=pa.schema([SHARD_SCHEMA.field(name) for name in names]))


def test_a_lineage_says_its_adapter_and_the_version_that_sampled_each_token() -> None:
    """A session on adapter "sql" whose second call ran after a push of version 2: the lineage says
    "sql", and each sampled token the version it was sampled under; a base session says null and -1."""
    rows = [on_adapter(call(0, [1, 2], [3, 4]), "sql", 1),
            on_adapter(call(1, [1, 2, 3, 4, 5], [6], parent=(0, 0)), "sql", 2),
            on_adapter(call(0, [1, 2], [7], session="b"), None, None)]
    base, sql = pipeline.read_trajectories(adapter_table(rows), rewards={}).to_pylist()
    assert (sql["session_id"], sql["adapter"]) == ("s", "sql")
    assert sql["token_adapter_version"] == [-1, -1, 1, 1, -1, 2]
    assert (base["adapter"], base["token_adapter_version"]) == (None, [-1, -1, -1])
    assert read(linear_conversation())[0]["adapter"] is None  # rows written before adapters: the base


def test_a_call_continued_across_a_partial_adapter_push_gives_each_token_its_version() -> None:
    """The second call's sample was stopped by a partial push of v3 after two tokens and continued on it."""
    rows = [on_adapter(call(0, [1, 2], [3, 4]), "sql", 2),
            on_adapter(call(1, [1, 2, 3, 4, 5], [6, 7, 8, 9], parent=(0, 0)), "sql", 2, [(0, 2), (2, 3)])]
    (sql,) = pipeline.read_trajectories(adapter_table(rows), rewards={}).to_pylist()
    assert sql["token_adapter_version"] == [-1, -1, 2, 2, -1, 2, 2, 3, 3]


def test_a_call_on_another_adapter_starts_a_lineage_of_that_policy() -> None:
    """Call 1 extends call 0 but ran on another adapter (its `model` named one): each policy trains on
    its own samples only. Call 0 ends the sql lineage; call 1 starts the math one, call 0's tokens its
    prompt (loss mask 0), its parent named; call 2, back on sql, extends call 1 and starts a third."""
    rows = [on_adapter(call(0, [1, 2], [3]), "sql", 1),
            on_adapter(call(1, [1, 2, 3, 4], [5], parent=(0, 0)), "math", 1),
            on_adapter(call(2, [1, 2, 3, 4, 5, 6], [7], parent=(1, 0)), "sql", 1)]
    sql, math, back = pipeline.read_trajectories(adapter_table(rows), rewards={}).to_pylist()
    assert [(t["adapter"], t["turns"], t["parent_turn"]) for t in (sql, math, back)] == [
        ("sql", [0], None), ("math", [1], 0), ("sql", [2], 1)]
    assert (math["input_ids"], math["loss_mask"]) == ([1, 2, 3, 4, 5], [0, 0, 0, 0, 1])
    assert back["loss_mask"] == [0, 0, 0, 0, 0, 0, 1]
