"""Reading routed experts: row/table helpers with layer and position slices, mixed uint8/uint16
shards, and alignment to the padded and packed torch layouts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import pipeline
from pipeline.core.routed_experts import ROUTED_EXPERTS_COLUMNS
from pipeline.read.torch_data import RolloutBatches, collate_rollouts
from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.rows.shard_writer import write_shard
from workers.rows.table import RowContext, build_table

LAYERS, TOP_K = 3, 2


def _shard(tmp_path: Path, job: str, num_experts: int, specs: list[tuple[int, int, bool]], seed: int = 0):  # type: ignore[no-untyped-def]
    """Rows (prompt, completion, with experts?) -> (table as written, arrays by row as stored:
    each (position, layer)'s ids ascending, `np.sort` of what the engine reported)."""
    rng = np.random.default_rng(seed)
    requests, outputs, arrays = [], [], []
    for i, (prompt, completion, routed) in enumerate(specs):
        requests.append(RolloutRequest(id=f"{job}-{i}", input_ids=list(range(1, prompt + 1)),
                                       return_routed_experts=routed, sampling_params={"max_new_tokens": 16}))
        experts = rng.integers(0, num_experts, (prompt + completion - 1, LAYERS, TOP_K)) if routed else None
        arrays.append(None if experts is None else np.sort(experts, axis=-1))
        outputs.append([SampleOutput(token_ids=np.arange(1, completion + 1, dtype=np.int32), finish=Finish("length"),
                                     logprobs=np.zeros(completion, np.float32), routed_experts=experts)])
    now = datetime.now(UTC)
    ctx = RowContext(run="r", job_id=job, engine="hf", model="m", worker_id="w", weight_version=0,
                     submitted_at=now, started_at=now, finished_at=now, num_experts=num_experts)
    table = build_table(requests, outputs, ctx)
    write_shard(table, f"file://{tmp_path}", "r", job)
    return table, arrays


def test_table_and_row_helpers_slice_layers_and_positions(tmp_path: Path) -> None:
    table, arrays = _shard(tmp_path, "a", 8, [(3, 4, True), (2, 1, False), (5, 2, True)])
    got = pipeline.routed_experts(table)
    assert got[1] is None
    for g, w in zip([got[0], got[2]], [arrays[0], arrays[2]], strict=True):
        np.testing.assert_array_equal(g, w)
    sliced = pipeline.routed_experts(table, layers=slice(1, 3), positions=slice(2, 5))
    np.testing.assert_array_equal(sliced[0], arrays[0][2:5, 1:3])
    views = pipeline.routed_experts(table.slice(2), layers=slice(0, 1), copy=False)
    assert views[0].base is not None and not views[0].flags.owndata
    np.testing.assert_array_equal(views[0], arrays[2][:, :1])
    row = table.to_pylist()[2]
    np.testing.assert_array_equal(pipeline.routed_experts(row, positions=slice(-2, None)), arrays[2][-2:])
    assert pipeline.routed_experts(table.to_pylist()[1]) is None
    # Positions are token positions: with start 2, positions 0..1 were not captured.
    shifted = {**row, "routed_experts_start": 2, "routed_experts_shape": [4, LAYERS, TOP_K],
               "routed_experts": row["routed_experts"][: 4 * LAYERS * TOP_K]}
    np.testing.assert_array_equal(pipeline.routed_experts(shifted, positions=slice(0, 4)), arrays[2][:2])
    assert pipeline.routed_experts_positions(2, 4, slice(0, None, 3)) == range(3, 6, 3)


def test_run_mixing_uint8_and_uint16_shards_reads(tmp_path: Path) -> None:
    small, small_arrays = _shard(tmp_path, "a-small", 8, [(3, 2, True)], seed=1)
    big, big_arrays = _shard(tmp_path, "b-big", 300, [(2, 3, True), (2, 2, True)], seed=2)
    assert small.schema.field("routed_experts").type.value_type == pa.uint8()
    assert big.schema.field("routed_experts").type.value_type == pa.uint16()
    # Shards of one run read together (the reader casts), whatever the first shard's type is.
    table = pipeline.read_rollouts(f"file://{tmp_path}", "r", columns=["request_id", *ROUTED_EXPERTS_COLUMNS])
    got = dict(zip(table.column("request_id").to_pylist(), pipeline.routed_experts(table), strict=True))
    np.testing.assert_array_equal(got["a-small-0"], small_arrays[0])
    np.testing.assert_array_equal(got["b-big-1"], big_arrays[1])
    batches = list(RolloutBatches(f"file://{tmp_path}", run="r", batch_size=8, routed_experts=True))
    assert len(batches) == 1 and batches[0]["routed_experts"].dtype.is_signed  # int32 for uint16 rows


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collate_aligns_experts_to_token_positions(tmp_path: Path, layout: str) -> None:
    table, arrays = _shard(tmp_path, "a", 8, [(3, 4, True), (2, 1, False), (5, 2, True)])
    batch = collate_rollouts(table, layout=layout, routed_experts=True)  # type: ignore[arg-type]
    experts, mask = batch["routed_experts"], batch["routed_experts_mask"]
    lengths = [7, 3, 7]
    if layout == "packed":
        assert experts.shape == (1, sum(lengths), LAYERS, TOP_K) and mask.shape == (1, sum(lengths))
        bounds = np.cumsum([0, *lengths])
        rows = [(experts[0, bounds[b] : bounds[b + 1]], mask[0, bounds[b] : bounds[b + 1]]) for b in range(3)]
    else:
        assert experts.shape == (3, 7, LAYERS, TOP_K) and mask.shape == (3, 7)
        rows = [(experts[b, : lengths[b]], mask[b, : lengths[b]]) for b in range(3)]
        assert not mask[1].any() and not mask[:, 7:].any()
    assert experts.dtype.itemsize == 1  # uint8 kept for <= 256 experts
    for (row_experts, row_mask), want, length in zip(rows, arrays, lengths, strict=True):
        if want is None:
            assert not row_mask.any() and not row_experts.any()
            continue
        # Position t holds the experts that routed token t; the last token was never routed.
        assert row_mask[: length - 1].all() and not row_mask[length - 1]
        np.testing.assert_array_equal(row_experts[: length - 1].numpy(), want)
