"""The torch reader: padded and packed layouts against a naive per-token reference, loss masks,
group-aware batching over shards, and that `import pipeline` leaves torch alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from pipeline.core.errors import NoShardsError, PipelineError
from pipeline.core.shards import finish_reason_in
from pipeline.read.torch_data import RolloutBatches, collate_rollouts, grpo_advantages, pack_groups
from schemas.shard import REWARDS_SCHEMA, REWARDS_SUFFIX, SHARD_SCHEMA
from workers.rows.shard_writer import write_shard

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def shard_table(samples: list[dict[str, Any]], run: str = "r", job_id: str = "j") -> pa.Table:
    """A full shard table (SHARD_SCHEMA) from samples giving request_id, sample_index, prompt,
    completion, logprobs (None for none) and optionally weight_version and finish_reason."""
    rows = []
    for s in samples:
        rows.append({
            "rollout_id": f"{s['request_id']}:{s['sample_index']}",
            "request_id": s["request_id"], "run": run, "job_id": job_id,
            "sample_index": s["sample_index"],
            "prompt_token_ids": s["prompt"], "completion_token_ids": s["completion"],
            "completion_logprobs": s["logprobs"], "completion_top_logprobs": None,
            "prompt_logprobs": None, "completion_text": None,
            "finish_reason": s.get("finish_reason", "length"),
            "stop_reason_text": None, "stop_reason_token": None, "routed_experts": None,
            "routed_experts_shape": None, "routed_experts_start": None,
            "weight_version": s.get("weight_version", 0), "temperature": 1.0, "top_p": 1.0,
            "top_k": -1, "min_p": 0.0, "seed": None, "max_new_tokens": 64,
            "prompt_tokens": len(s["prompt"]), "completion_tokens": len(s["completion"]),
            "cached_tokens": 0, "engine": "test", "model": "test", "worker_id": "w",
            "submitted_at": NOW, "started_at": NOW, "finished_at": NOW,
            "metadata": json.dumps({"group": s["request_id"]}),
        })
    return pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)


def random_samples(
    rng: np.random.Generator, requests: int, n: int, prefix: str = "q", with_nulls: bool = True
) -> list[dict[str, Any]]:
    samples = []
    for r in range(requests):
        prompt = rng.integers(1, 1000, rng.integers(1, 9)).tolist()
        for i in range(n):
            length = int(rng.integers(0, 12))
            samples.append({
                "request_id": f"{prefix}{r}", "sample_index": i, "prompt": prompt,
                "completion": rng.integers(1, 1000, length).tolist(),
                "logprobs": None if with_nulls and rng.random() < 0.2
                else (-rng.random(length)).astype(np.float32).tolist(),
                "weight_version": int(rng.integers(0, 5)),
            })
    return samples


def naive_padded(samples: list[dict[str, Any]], pad_id: int, width: int) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    for s in samples:
        ids = s["prompt"] + s["completion"]
        lps = s["logprobs"] if s["logprobs"] is not None else [0.0] * len(s["completion"])
        pad = width - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["attention_mask"].append([1] * len(ids) + [0] * pad)
        out["loss_mask"].append([False] * len(s["prompt"]) + [True] * len(s["completion"]) + [False] * pad)
        out["old_logprobs"].append([0.0] * len(s["prompt"]) + list(lps) + [0.0] * pad)
        out["weight_version"].append(s["weight_version"])
    return out


def naive_packed(samples: list[dict[str, Any]]) -> dict[str, list]:
    out: dict[str, list] = defaultdict(list)
    cu = [0]
    for s in samples:
        ids = s["prompt"] + s["completion"]
        lps = s["logprobs"] if s["logprobs"] is not None else [0.0] * len(s["completion"])
        out["input_ids"].extend(ids)
        out["position_ids"].extend(range(len(ids)))
        out["loss_mask"].extend([False] * len(s["prompt"]) + [True] * len(s["completion"]))
        out["old_logprobs"].extend([0.0] * len(s["prompt"]) + list(lps))
        cu.append(cu[-1] + len(ids))
    out["cu_seqlens"] = cu
    return out


def chunked(table: pa.Table, pieces: int) -> pa.Table:
    """The same rows in several record batches, the first one a slice with a nonzero offset."""
    step = max(1, -(-table.num_rows // pieces))
    return pa.Table.from_batches(
        [b for start in range(0, table.num_rows, step) for b in table.slice(start, step).to_batches()],
        schema=table.schema,
    )


@pytest.mark.parametrize("pieces", [1, 3])
def test_padded_layout_matches_naive_reference_position_by_position(pieces: int) -> None:
    rng = np.random.default_rng(1)
    samples = random_samples(rng, requests=9, n=3)
    table = chunked(shard_table(samples), pieces)
    pad_id = 99_999
    out = collate_rollouts(table, layout="padded", pad_id=pad_id, pad_to_multiple_of=8)
    longest = max(len(s["prompt"]) + len(s["completion"]) for s in samples)
    width = -(-longest // 8) * 8
    ref = naive_padded(samples, pad_id, width)
    assert out["input_ids"].shape == (len(samples), width)
    assert out["input_ids"].dtype == torch.int64
    assert out["input_ids"].tolist() == ref["input_ids"]
    assert out["attention_mask"].dtype == torch.bool
    assert out["attention_mask"].long().tolist() == ref["attention_mask"]
    assert out["loss_mask"].dtype == torch.bool
    assert out["loss_mask"].tolist() == ref["loss_mask"]
    np.testing.assert_array_equal(out["old_logprobs"].numpy(), np.array(ref["old_logprobs"], np.float32))
    assert out["weight_version"].tolist() == ref["weight_version"]


@pytest.mark.parametrize("pieces", [1, 4])
def test_packed_layout_matches_naive_reference_position_by_position(pieces: int) -> None:
    rng = np.random.default_rng(2)
    samples = random_samples(rng, requests=7, n=4)
    out = collate_rollouts(chunked(shard_table(samples), pieces), layout="packed")
    ref = naive_packed(samples)
    total = len(ref["input_ids"])
    assert out["input_ids"].shape == (1, total)
    assert out["input_ids"][0].tolist() == ref["input_ids"]
    assert out["position_ids"][0].tolist() == ref["position_ids"]
    assert out["loss_mask"][0].tolist() == ref["loss_mask"]
    np.testing.assert_array_equal(out["old_logprobs"][0].numpy(), np.array(ref["old_logprobs"], np.float32))
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == ref["cu_seqlens"]
    assert out["max_seqlen"] == max(len(s["prompt"]) + len(s["completion"]) for s in samples)
    assert out["weight_version"].tolist() == [s["weight_version"] for s in samples]
    assert "attention_mask" not in out


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_loss_mask_covers_exactly_the_completion_tokens(layout: str) -> None:
    rng = np.random.default_rng(3)
    samples = random_samples(rng, requests=6, n=4, with_nulls=False)
    out = collate_rollouts(shard_table(samples), layout=layout, pad_id=0)
    ids = out["input_ids"].reshape(len(samples), -1) if layout == "padded" else out["input_ids"][0]
    mask = out["loss_mask"].reshape(ids.shape)
    assert int(mask.sum()) == sum(len(s["completion"]) for s in samples)
    if layout == "padded":
        for row, s in enumerate(samples):
            assert ids[row][mask[row]].tolist() == s["completion"]
            assert torch.nonzero(mask[row]).flatten().tolist() == list(
                range(len(s["prompt"]), len(s["prompt"]) + len(s["completion"]))
            )
    else:
        assert ids[mask].tolist() == [t for s in samples for t in s["completion"]]
    # logprobs sit exactly under the mask
    lps = out["old_logprobs"].reshape(mask.shape)
    assert lps[mask].tolist() == pytest.approx([lp for s in samples for lp in s["logprobs"]])
    assert not lps[~mask].any()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collate_of_no_rows_gives_empty_tensors(layout: str) -> None:
    for empty in (SHARD_SCHEMA.empty_table(), pa.Table.from_batches([], schema=SHARD_SCHEMA)):
        out = collate_rollouts(empty, layout=layout)
        assert out["input_ids"].numel() == 0
        assert out["weight_version"].shape == (0,)


def test_collate_refuses_rows_breaking_the_logprob_contract() -> None:
    samples = [{"request_id": "q", "sample_index": 0, "prompt": [1], "completion": [2, 3],
                "logprobs": [-0.5]}]
    with pytest.raises(PipelineError, match="1 completion logprobs for 2 completion tokens"):
        collate_rollouts(shard_table(samples))


def test_collate_names_a_missing_column_and_layout() -> None:
    samples = random_samples(np.random.default_rng(4), requests=1, n=1)
    table = shard_table(samples)
    with pytest.raises(PipelineError, match="completion_logprobs"):
        collate_rollouts(table.drop_columns(["completion_logprobs"]))
    with pytest.raises(PipelineError, match="layout"):
        collate_rollouts(table, layout="ragged")  # type: ignore[arg-type]


def test_pack_groups_keeps_groups_whole() -> None:
    assert pack_groups([4, 4, 4, 4], 8) == [2, 2]
    assert pack_groups([4, 4, 4], 10) == [2, 1]
    assert pack_groups([12, 4], 8) == [1, 1]  # an oversized group is a batch of its own
    assert pack_groups([4, 4], 8, carried=6) == [0, 2]  # the carried rows close first


def write_shards(tmp_path: Path, shards: list[list[dict[str, Any]]], run: str = "r") -> str:
    output = str(tmp_path / "out")
    for index, samples in enumerate(shards):
        write_shard(shard_table(samples, run=run, job_id=f"j{index}"), output, run, f"j{index}")
    return output


@pytest.mark.parametrize("batch_size", [8, 10, 13])
@pytest.mark.parametrize("shuffle", [False, True])
def test_group_batching_keeps_all_four_samples_of_a_request_together(
    tmp_path: Path, batch_size: int, shuffle: bool
) -> None:
    rng = np.random.default_rng(5)
    shards = []
    for index in range(3):
        samples = random_samples(rng, requests=int(rng.integers(3, 8)), n=4, prefix=f"s{index}q")
        order = rng.permutation(len(samples))  # a request's samples not adjacent in the shard
        shards.append([samples[i] for i in order])
    output = write_shards(tmp_path, shards)
    dataset = RolloutBatches(
        output, run="r", batch_size=batch_size, shuffle=shuffle, seed=3,
        extra_columns=["request_id", "rollout_id"],
    )
    seen: Counter[str] = Counter()
    batch_of: dict[str, int] = {}
    batches = list(dataset)
    for number, batch in enumerate(batches):
        rids = batch["request_id"]
        assert len(rids) <= batch_size
        for rid in set(rids):
            assert rids.count(rid) == 4, f"request {rid} split across batches"
            assert rid not in batch_of
            batch_of[rid] = number
        # group_index numbers the requests of the batch 0..G-1, rows of a group adjacent
        groups = batch["group_index"].tolist()
        assert groups == sorted(groups)
        assert len(set(groups)) == len(set(rids))
        for g, rid in zip(groups, rids, strict=True):
            assert rids[groups.index(g)] == rid
        seen.update(batch["rollout_id"])
    every = [f"{s['request_id']}:{s['sample_index']}" for shard in shards for s in shard]
    assert seen == Counter(every)
    assert all(len(b["request_id"]) == batch_size - batch_size % 4 for b in batches[:-1])


def test_groups_stay_whole_when_a_shard_has_several_row_groups(tmp_path: Path) -> None:
    """The request ids come back as one dictionary per row group; their codes still group rows."""
    rng = np.random.default_rng(8)
    samples = random_samples(rng, requests=6, n=4, prefix="q")
    samples = [samples[i] for i in rng.permutation(len(samples))]
    output = write_shards(tmp_path, [samples])
    [path] = Path(output, "r").glob("*.parquet")
    pq.write_table(pq.read_table(path), path, row_group_size=5)  # 24 rows over 5 row groups
    assert pq.ParquetFile(path).num_row_groups == 5
    batches = list(RolloutBatches(output, run="r", batch_size=8, extra_columns=["request_id", "rollout_id"]))
    seen = []
    for batch in batches:
        rids = batch["request_id"]
        assert all(rids.count(rid) == 4 for rid in rids)
        seen.extend(batch["rollout_id"])
    assert sorted(seen) == sorted(f"{s['request_id']}:{s['sample_index']}" for s in samples)


def test_batches_carry_the_right_rows(tmp_path: Path) -> None:
    """Each batch's tensors are those of its own rows (checked against the reference)."""
    rng = np.random.default_rng(6)
    shards = [random_samples(rng, 3, 4, prefix=f"s{i}q") for i in range(2)]
    output = write_shards(tmp_path, shards)
    by_id = {f"{s['request_id']}:{s['sample_index']}": s for shard in shards for s in shard}
    loader = DataLoader(
        RolloutBatches(output, run="r", batch_size=8, pad_id=-1, extra_columns=["rollout_id"]),
        batch_size=None,
    )
    for batch in loader:
        samples = [by_id[r] for r in batch["rollout_id"]]
        ref = naive_padded(samples, -1, batch["input_ids"].shape[1])
        assert batch["input_ids"].tolist() == ref["input_ids"]
        assert batch["loss_mask"].tolist() == ref["loss_mask"]


def test_packed_batches_filters_and_dataloader_workers(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    shards = [random_samples(rng, 4, 4, prefix=f"s{i}q") for i in range(4)]
    for shard in shards:
        for s in shard:
            s["finish_reason"] = "stop" if s["sample_index"] % 2 else "length"
    output = write_shards(tmp_path, shards)
    dataset = RolloutBatches(
        output, run="r", batch_size=16, layout="packed", filter=finish_reason_in("stop"),
        extra_columns=["rollout_id"],
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    got = []
    for batch in loader:
        cu = batch["cu_seqlens"].tolist()
        assert len(cu) == len(batch["rollout_id"]) + 1
        assert cu[-1] == batch["input_ids"].shape[1]
        got.extend(batch["rollout_id"])
    expected = [f"{s['request_id']}:{s['sample_index']}" for shard in shards for s in shard
                if s["finish_reason"] == "stop"]
    assert sorted(got) == sorted(expected)


def test_a_misspelled_run_is_an_error_not_an_empty_epoch(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    output = write_shards(tmp_path, [random_samples(rng, requests=2, n=2, prefix="q")])
    expected = f"no shards under {output}/rr \\(run 'rr' of output {output}\\): .*did you mean 'r'"
    with pytest.raises(NoShardsError, match=expected):
        list(RolloutBatches(output, run="rr", batch_size=4))


def test_the_readme_grpo_example_runs_and_trains(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    start = readme.index("```python\nimport torch\nfrom torch.utils.data import DataLoader\n")
    example = readme[start + len("```python\n"): readme.index("```", start + 3)]
    rng = np.random.default_rng(5)
    samples = random_samples(rng, requests=4, n=4, prefix="q", with_nulls=False)
    output = write_shards(tmp_path, [samples], run="step-42")
    ids = [f"{s['request_id']}:{s['sample_index']}" for s in samples]
    pq.write_table(pa.table({"rollout_id": ids, "reward": rng.random(len(ids)), "reward_info": [None] * len(ids)},
                            schema=REWARDS_SCHEMA), f"{output}/step-42/j0{REWARDS_SUFFIX}")

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
            return type("Output", (), {"logits": self.head(self.embed(input_ids))})

    model = TinyLM()
    before = model.head.weight.detach().clone()
    scope: dict[str, Any] = {"OUT": output, "model": model,
                             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(compile(example, "README.md", "exec"), scope)
    assert torch.isfinite(scope["loss"]) and not torch.equal(model.head.weight, before)


def test_import_pipeline_does_not_import_torch_transformers_or_sglang() -> None:
    """Every module of `pipeline` but the torch side (`torch_data`, `trajectory_batches`, `importance`, `tree_packing`)
    loads without torch, transformers or sglang (a trainer-side install has none of them); those load torch."""
    code = (
        "import importlib, pkgutil, sys, pipeline\n"
        "names = [m.name for m in pkgutil.walk_packages(pipeline.__path__, 'pipeline.')]\n"
        "assert 'pipeline.cli.main' in names and 'pipeline.read.torch_data' in names, names\n"
        "for name in names:\n"
        "    if name not in ('pipeline.read.torch_data', 'pipeline.read.trajectory_batches', "
        "'pipeline.read.importance', 'pipeline.read.tree_packing', 'pipeline.core.weights.torch_bits'):\n"
        "        importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'sglang'))\n"
        "assert not heavy, heavy[:5]\n"
        "import pipeline.read.torch_data\n"
        "assert 'torch' in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_weight_version_follows_the_segments(layout: str) -> None:
    samples = [
        {"request_id": "a", "sample_index": 0, "prompt": [1, 2], "completion": [3, 4, 5, 6], "logprobs": None,
         "weight_version": 2},
        {"request_id": "b", "sample_index": 0, "prompt": [1], "completion": [7, 8, 9], "logprobs": None,
         "weight_version": 5},
        {"request_id": "c", "sample_index": 0, "prompt": [4, 4, 4], "completion": [], "logprobs": None,
         "weight_version": 1},
    ]
    table = shard_table(samples)
    segments = pa.array([[{"start": 0, "version": 2}, {"start": 1, "version": 3}, {"start": 3, "version": 4}],
                         None, None], type=table.schema.field("weight_version_segments").type)
    table = table.set_column(table.schema.get_field_index("weight_version_segments"),
                             "weight_version_segments", segments)
    batch = collate_rollouts(table, layout=layout)  # type: ignore[arg-type]
    versions = batch["token_weight_version"]
    mask = batch["loss_mask"]
    assert versions.dtype == torch.int64 and versions.shape == mask.shape
    assert bool((versions[~mask] == -1).all())
    assert versions[mask].tolist() == [2, 3, 3, 4, 5, 5, 5]
    # A table without the column (written before per-token versions): each row's weight_version.
    plain = collate_rollouts(table.drop_columns(["weight_version_segments"]), layout=layout)  # type: ignore[arg-type]
    assert plain["token_weight_version"][plain["loss_mask"]].tolist() == [2, 2, 2, 2, 5, 5, 5]


def test_token_weight_version_through_rolloutbatches(tmp_path: Path) -> None:
    table = shard_table([{"request_id": "a", "sample_index": 0, "prompt": [1], "completion": [3, 4],
                          "logprobs": [-0.1, -0.2], "weight_version": 7}])
    segments = pa.array([[{"start": 0, "version": 7}, {"start": 1, "version": 8}]],
                        type=table.schema.field("weight_version_segments").type)
    table = table.set_column(table.schema.get_field_index("weight_version_segments"),
                             "weight_version_segments", segments)
    write_shard(table, f"file://{tmp_path}", "r", "j")
    (batch,) = list(RolloutBatches(f"file://{tmp_path}", run="r"))
    assert batch["token_weight_version"][batch["loss_mask"]].tolist() == [7, 8]


def test_rewards_and_grpo_advantages_per_group(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    shards = [random_samples(rng, requests=3, n=4, prefix=f"s{i}q") for i in range(2)]
    output = write_shards(tmp_path, shards)
    reward_of: dict[str, float] = {}
    for index, samples in enumerate(shards[:1]):  # only the first shard has its rewards yet
        ids = [f"{s['request_id']}:{s['sample_index']}" for s in samples]
        values = [float(rng.integers(0, 3)) if not s["request_id"].endswith("q0") else 1.0 for s in samples]
        reward_of.update(zip(ids, values, strict=True))
        pq.write_table(pa.table({"rollout_id": ids, "reward": values, "reward_info": [None] * len(ids)},
                                schema=REWARDS_SCHEMA), f"{output}/r/j{index}{REWARDS_SUFFIX}")
    batches = list(RolloutBatches(output, run="r", batch_size=64, rewards=True, extra_columns=["rollout_id"]))
    [batch] = batches
    for rid, reward in zip(batch["rollout_id"], batch["rewards"].tolist(), strict=True):
        assert (reward == reward_of[rid]) if rid in reward_of else np.isnan(reward)
    with pytest.raises(PipelineError, match=r"12 row.* have no reward"):
        list(RolloutBatches(output, run="r", batch_size=64, rewards=True, advantages=True))
    # Advantages against a plain per-group reference: (r - mean) / (sample std + eps).
    first = f"{output}/r/j0.parquet"
    [batch] = list(RolloutBatches([first], batch_size=64, rewards=True, advantages=True,
                                  extra_columns=["request_id", "rollout_id"]))
    for rid, advantage in zip(batch["rollout_id"], batch["advantages"].tolist(), strict=True):
        group = [reward_of[r] for r in reward_of if r.split(":")[0] == rid.split(":")[0]]
        std = float(np.std(group, ddof=1))
        assert advantage == pytest.approx((reward_of[rid] - float(np.mean(group))) / (std + 1e-6), abs=1e-5)
    q0 = [a for rid, a in zip(batch["rollout_id"], batch["advantages"].tolist(), strict=True) if ":" in rid
          and rid.split(":")[0].endswith("q0")]
    assert q0 == [0.0] * 4  # all-equal rewards: no advantage
    assert grpo_advantages(np.array([2.0], np.float32), np.array([0])).tolist() == [0.0]  # a group of one
