"""Lineages as one tree and one packed sequence: each shared token stored and computed once, and a
forward pass over the packed tree gives every lineage's per-token logprobs as that lineage run alone:
on a random Llama (eager and sdpa attention) within 1e-5 in float32; on the demo model (30 layers)
within 1e-10 in float64, and in float32 within its summation-order noise (running a lineage with
unrelated tokens appended after it moves its logprobs by up to 9e-6; the packed tree, whose
attention sums over more keys in another order, by up to 2.5e-5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import pipeline
from pipeline.read.tree_packing import collate_tree, lineage_logprobs, pack_tree
from pipeline.read.trees import FIELDS, read_trees, token_tree
from tests.pipeline.read.test_lineages import call, table

TOLERANCE = 1e-5
DEMO_FLOAT32_TOLERANCE = 5e-5


def agent_session(seed: int = 0, vocab: int = 64) -> list[dict[str, Any]]:
    """A main agent (0, 3, 4), two sub-agents under the same system prompt (1 → 6, and 2), a call with
    n=2 both of whose samples are continued (3 → 4 and 3 → 5), and a compaction (7 → 8)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1, vocab, size=n)]

    system = ids(12)
    main = system + ids(5)
    rows = [call(0, main, ids(4)), call(1, system + ids(3), ids(3)), call(2, system + ids(4), ids(2))]
    p3 = main + rows[0]["completion_token_ids"] + ids(3)
    rows += [call(3, p3, ids(3), sample=0, parent=(0, 0)), call(3, p3, ids(5), sample=1, parent=(0, 0))]
    rows.append(call(4, p3 + rows[4]["completion_token_ids"] + ids(2), ids(3), parent=(3, 1)))
    rows.append(call(5, p3 + rows[3]["completion_token_ids"] + ids(4), ids(2), parent=(3, 0)))
    rows.append(call(6, rows[1]["prompt_token_ids"] + rows[1]["completion_token_ids"] + ids(2), ids(4), parent=(1, 0)))
    compacted = system + ids(6)
    rows.append(call(7, compacted, ids(3)))
    rows.append(call(8, compacted + rows[-1]["completion_token_ids"] + ids(2), ids(3), parent=(7, 0)))
    return rows


def lineage_rows(seed: int = 0, vocab: int = 64) -> list[dict[str, Any]]:
    return pipeline.read_trajectories(table(agent_session(seed, vocab)), rewards={}).to_pylist()


def test_the_tree_stores_each_shared_token_once_and_gives_every_lineage_back() -> None:
    rows = lineage_rows()
    assert [r["turns"] for r in rows] == [[2], [0, 3, 4], [0, 3, 5], [1, 6], [7, 8]]
    tree = token_tree(rows)
    for index, row in enumerate(rows):
        back = tree.lineage(index)
        for name in FIELDS:
            assert back[name].tolist() == pytest.approx(row[name]), (index, name)
    # Stored once: a radix tree holds one token per distinct lineage prefix; at least the system prompt
    # (12 tokens, under all four roots) and call 3's prompt (under both of its samples) are shared.
    keyed = [list(zip(*(r[name] for name in FIELDS), strict=True)) for r in rows]
    assert tree.tokens == len({tuple(k[:end]) for k in keyed for end in range(1, len(k) + 1)})
    call_3_prompt = rows[1]["turn_starts"][1]
    assert tree.tokens <= sum(len(k) for k in keyed) - 3 * 12 - (call_3_prompt - 12)
    assert sum(node.parent < 0 for node in tree.nodes) == 1  # one root: the system prompt


def test_the_packed_tree_attends_each_token_to_exactly_its_own_lineage() -> None:
    rows = lineage_rows()
    packed = pack_tree(token_tree(rows))
    assert len(packed.input_ids) == token_tree(rows).tokens
    for row, positions in zip(rows, packed.lineage_positions, strict=True):
        assert packed.input_ids[positions].tolist() == row["input_ids"]
        assert packed.loss_mask[positions].tolist() == row["loss_mask"]
        assert packed.old_logprobs[positions].tolist() == pytest.approx(row["old_logprobs"])
        assert packed.token_weight_version[positions].tolist() == row["token_weight_version"]
        assert packed.position_ids[positions].tolist() == list(range(len(positions)))
        assert packed.previous[positions].tolist() == [-1, *positions[:-1].tolist()]
        for j, position in enumerate(positions):
            assert set(np.flatnonzero(packed.attention[position])) == set(positions[: j + 1].tolist())


def assert_packed_equals_alone(model: Any, rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> None:
    batch = collate_tree(pack_tree(token_tree(rows)), dtype=model.dtype)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        for index, (row, got) in enumerate(zip(rows, lineage_logprobs(logits, batch), strict=True)):
            ids = torch.tensor(row["input_ids"])
            alone = torch.log_softmax(model(input_ids=ids[None]).logits[0], dim=-1)
            want = torch.cat([torch.zeros(1, dtype=alone.dtype), alone[:-1].gather(1, ids[1:, None])[:, 0]])
            assert got.shape == want.shape and (got - want).abs().max().item() <= tolerance, index


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_logprobs_equal_each_lineage_alone_on_a_random_llama(attention: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation=attention)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked logits: a wrong mask moves them by far more than 1e-5
    for seed in range(3):
        assert_packed_equals_alone(model, lineage_rows(seed))
    assert_packed_equals_alone(model, lineage_rows(0) + lineage_rows(1))  # two sessions: a tree of two roots


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, DEMO_FLOAT32_TOLERANCE)])
def test_packed_logprobs_equal_each_lineage_alone_on_the_demo_model(dtype: torch.dtype, tolerance: float) -> None:
    from workers.errors import EngineUnavailableError

    try:
        from workers.engines.hf.demo_model import ensure_demo_model

        path = ensure_demo_model()
    except EngineUnavailableError as error:
        pytest.skip(f"the demo model is not installed: {error}")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    assert_packed_equals_alone(model, lineage_rows(0, vocab=model.config.vocab_size), tolerance)


def test_read_trees_is_one_tree_per_session() -> None:
    rows = agent_session() + [{**r, "session_id": "t"} for r in agent_session(1)]
    trees = read_trees(table(rows), rewards={"s": {"reward": 1.0}})
    assert [{lin["session_id"] for lin in tree.lineages} for tree in trees] == [{"s"}, {"t"}]
    assert [lin["reward"] for lin in trees[0].lineages] == [1.0] * 5
    assert collate_tree(pack_tree(trees[1]))["reward"].isnan().all()


def test_lineages_of_two_adapters_share_no_token_and_are_not_packed_together() -> None:
    """Under another LoRA adapter the same prompt has other states: two sessions with one prompt, one
    on the base and one on an adapter, get a root each (the base ones share theirs), and packing
    lineages of two adapters into one forward pass is refused."""
    from tests.pipeline.read.test_lineages import adapter_table, on_adapter

    rows = [on_adapter(call(0, [1, 2, 3], [4], session="a"), None, None),
            on_adapter(call(0, [1, 2, 3], [5], session="b"), None, None),
            on_adapter(call(0, [1, 2, 3], [6], session="c"), "sql", 3)]
    items = pipeline.read_trajectories(adapter_table(rows), rewards={}).to_pylist()
    tree = token_tree(items)
    assert tree.tokens == 3 + 1 + 1 + 4  # the base sessions share [1, 2, 3]; the adapter's has its own
    assert [tree.lineage(i)["token_adapter_version"].tolist() for i in range(3)] == [[-1] * 4, [-1] * 4,
                                                                                     [-1, -1, -1, 3]]
    with pytest.raises(pipeline.PipelineError, match=r"ran on 2 adapters \(\[None, 'sql'\]\)"):
        pack_tree(tree)
    packed = collate_tree(pack_tree(token_tree(items[:2])))
    assert packed["token_adapter_version"].tolist() == [[-1] * 5]
