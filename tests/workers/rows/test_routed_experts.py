"""Routed experts end to end on a tiny random MoE: HF capture against a teacher-forced forward,
shapes for n > 1 and EOS stops, the Parquet round trip, the SGLang payload, a real worker.

Engines report each (position, layer)'s top-k in their own order; the shard stores the set as
ascending ids (`workers.rows.table.canonical_routed_experts`), so stored values are compared with
`np.sort(expected, -1)`, exactly."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import torch
from transformers import AutoModelForCausalLM

import pipeline
from schemas.request import RolloutRequest
from tests.helpers.models import CHARS, build_random_moe_model, token_id
from workers.engines.base import Finish, SampleOutput
from workers.engines.hf.engine import HFEngine
from workers.engines.request_support import check_request_supported
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.engines.sglang.mapping import parse_result
from workers.errors import ContractViolation, UnsupportedRequestError
from workers.process.worker import RolloutWorker
from workers.rows.shard_writer import write_shard
from workers.rows.table import RowContext, build_table, canonical_routed_experts

LAYERS, TOP_K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe(tiny_moe_dir: Path) -> HFEngine:
    return HFEngine(tiny_moe_dir)


@pytest.fixture(scope="module")
def reference(tiny_moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()


def teacher_forced_top_k(model: torch.nn.Module, sequence: list[int]) -> np.ndarray:
    """`[positions, layers, top_k]`: top-k of each layer's router logits over the whole sequence."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([sequence]), output_router_logits=True)
    per_layer = [torch.topk(logits.float().softmax(-1), TOP_K, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy()


def request(prompt: str, *, n: int = 1, max_new_tokens: int = 8, **fields: object) -> RolloutRequest:
    return RolloutRequest(
        id="q", input_ids=[token_id(c) for c in prompt], return_routed_experts=True,
        sampling_params={"n": n, "max_new_tokens": max_new_tokens, "seed": 3, **fields},
    )


def test_moe_engine_advertises_routed_experts(moe: HFEngine) -> None:
    assert moe.description.capabilities.routed_experts is True
    assert moe.description.num_experts == EXPERTS


@pytest.mark.parametrize("fields", [{"temperature": 1.0}, {"temperature": 0.0}])
def test_captured_ids_equal_teacher_forced_router_top_k(
    moe: HFEngine, reference: torch.nn.Module, fields: dict[str, float]
) -> None:
    req = request("hello world", n=3, **fields)
    samples = moe.generate([req])[0]
    rows = pipeline.routed_experts(build_table([req], [samples], _context(EXPERTS)))
    for sample, stored in zip(samples, rows, strict=True):
        sequence = req.input_ids + sample.token_ids.tolist()
        expected = teacher_forced_top_k(reference, sequence)
        assert sample.routed_experts_start == 0
        assert sample.routed_experts is not None
        # Every position fed through the model: all but the last sampled token.
        assert sample.routed_experts.shape == (len(sequence) - 1, LAYERS, TOP_K)
        # The engine reports the router's own order (score order for this model's torch.topk) ...
        np.testing.assert_array_equal(sample.routed_experts, expected[:-1])
        # ... and the row stores the same set per (position, layer), ascending.
        assert stored is not None and stored.shape == expected[:-1].shape
        np.testing.assert_array_equal(stored, np.sort(expected[:-1], axis=-1))


def test_requests_batched_with_left_padding_capture_their_own_positions(
    moe: HFEngine, reference: torch.nn.Module
) -> None:
    """Prompts of different lengths share one left-padded batch; each sample's rows are its own
    positions (the pads are not routed experts of anything)."""
    reqs = [request("hi", n=2), request("a longer prompt", n=1, temperature=0.0), request("mid way", n=1)]
    reqs = [r.model_copy(update={"id": f"q{i}"}) for i, r in enumerate(reqs)]
    for req, samples in zip(reqs, moe.generate(reqs), strict=True):
        for sample in samples:
            sequence = req.input_ids + sample.token_ids.tolist()
            assert sample.routed_experts is not None
            np.testing.assert_array_equal(sample.routed_experts, teacher_forced_top_k(reference, sequence)[:-1])


def test_shapes_for_n_samples_and_eos_stops(tmp_path: Path) -> None:
    # A few characters end a sequence too, so samples stop on EOS at different lengths.
    eos = [0, *(token_id(c) for c in CHARS[::20])]
    engine = HFEngine(build_random_moe_model(tmp_path / "moe", eos_ids=eos))
    req = request("abc", n=8, max_new_tokens=8)
    samples = engine.generate([req])[0]
    finishes = {s.finish.kind for s in samples}
    lengths = {len(s.token_ids) for s in samples}
    assert finishes == {"stop", "length"} and len(lengths) > 1, "the seed must give EOS stops and length stops"
    for sample in samples:
        rows = len(req.input_ids) + len(sample.token_ids) - 1
        assert sample.routed_experts is not None and sample.routed_experts.shape == (rows, LAYERS, TOP_K)
        assert sample.routed_experts.min() >= 0 and sample.routed_experts.max() < EXPERTS
        # Every sample shares the prompt, so their prompt positions route identically.
        np.testing.assert_array_equal(sample.routed_experts[:3], samples[0].routed_experts[:3])


def test_dense_model_rejects_routed_experts(tiny_model_dir: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    assert engine.description.capabilities.routed_experts is False
    assert engine.description.num_experts is None
    with pytest.raises(UnsupportedRequestError, match="routed experts"):
        check_request_supported(request("ab"), engine.description.served)
    with pytest.raises(UnsupportedRequestError, match="not a mixture-of-experts model"):
        engine.generate([request("ab")])


def _context(num_experts: int | None) -> RowContext:
    now = datetime.now(UTC)
    return RowContext(run="r", job_id="j", engine="hf", model="m", worker_id="w", weight_version=0,
                      submitted_at=now, started_at=now, finished_at=now, num_experts=num_experts)


def test_parquet_round_trip_is_exact_and_other_columns_skip_it(moe: HFEngine, tmp_path: Path) -> None:
    reqs = [request("hello", n=2), request("abc", n=1).model_copy(update={"id": "r"})]
    outputs = moe.generate(reqs)
    table = build_table(reqs, outputs, _context(moe.description.num_experts))
    assert table.schema.field("routed_experts").type == pa.list_(pa.uint8())
    url = write_shard(table, f"file://{tmp_path}", "run", "job")
    path = url.removeprefix("file://")
    back = pipeline.read_rollouts(url)
    got = pipeline.routed_experts(back)
    want = [s.routed_experts for samples in outputs for s in samples]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g is not None and w is not None and g.dtype == np.uint8 and g.shape == w.shape
        np.testing.assert_array_equal(g, np.sort(w, axis=-1))  # exactly the stored (ascending) form
    assert back.column("routed_experts_start").to_pylist() == [0, 0, 0]

    # Column projection: overwrite the routed-experts column chunk with garbage; the other
    # columns still read (never decoded it), and the column itself no longer does.
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema == "routed_experts.list.element")
    assert "BYTE_STREAM_SPLIT" in chunk.encodings and chunk.compression == "ZSTD"
    start = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o is not None)
    data = bytearray(Path(path).read_bytes())
    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    Path(path).write_bytes(bytes(data))
    others = [n for n in table.schema.names if n != "routed_experts"]
    assert pq.read_table(path, columns=others).to_pylist() == table.select(others).to_pylist()
    with pytest.raises(OSError):
        pq.read_table(path, columns=["routed_experts"])


def test_sglang_payload_round_trips_like_hf(tmp_path: Path) -> None:
    layout = ExpertsLayout(layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS)
    req = RolloutRequest(id="s", input_ids=[5, 6, 7], return_routed_experts=True, logprobs=None)
    routed = np.random.default_rng(0).integers(0, EXPERTS, (3 + 2 - 1, LAYERS, TOP_K)).astype(np.int32)
    assert (np.diff(routed, axis=-1) < 0).any(), "the payload must have a descending (position, layer)"
    payload = base64.b64encode(routed.tobytes()).decode("utf-8")  # SGLang: numpy int32 .tobytes() -> base64
    result = {"text": "", "output_ids": [8, 9],
              "meta_info": {"finish_reason": {"type": "length", "length": 2}, "routed_experts": payload}}
    sample = parse_result(req, result, layout=layout, who="t")
    np.testing.assert_array_equal(sample.routed_experts, routed)  # the engine output keeps SGLang's order
    table = build_table([req], [[sample]], _context(EXPERTS))
    url = write_shard(table, f"file://{tmp_path}", "run", "job")
    [back] = pipeline.routed_experts(pipeline.read_rollouts(url))
    assert back.dtype == np.uint8 and back.shape == routed.shape
    np.testing.assert_array_equal(back, np.sort(routed, axis=-1))
    # One position short, as a server that dropped the last fed token would send: a clear error.
    short = {**result, "meta_info": {**result["meta_info"], "routed_experts": base64.b64encode(
        routed[:-1].tobytes()).decode()}}
    with pytest.raises(ContractViolation, match="holds 12 ids, expected 16"):
        parse_result(req, short, layout=layout, who="t")


def test_unsorted_engine_output_is_stored_ascending(tmp_path: Path) -> None:
    req = RolloutRequest(id="u", input_ids=[5, 6], return_routed_experts=True, logprobs=None,
                         sampling_params={"max_new_tokens": 2})
    # [rows = 2 + 2 - 1, layers, top_k]: descending, ascending, and mixed pairs, as an engine may send.
    routed = np.array([[[7, 1], [2, 5]], [[6, 3], [0, 4]], [[1, 0], [5, 6]]], dtype=np.int32)
    before = routed.copy()
    sample = SampleOutput(token_ids=np.array([8, 9], np.int32), finish=Finish("length"), routed_experts=routed)
    table = build_table([req], [[sample]], _context(EXPERTS))
    want = np.array([[[1, 7], [2, 5]], [[3, 6], [0, 4]], [[0, 1], [5, 6]]], dtype=np.uint8)
    assert table.column("routed_experts").to_pylist() == [want.reshape(-1).tolist()]
    assert table.column("routed_experts_shape").to_pylist() == [[3, LAYERS, TOP_K]]
    np.testing.assert_array_equal(routed, before)  # the engine's array is left as it was
    url = write_shard(table, f"file://{tmp_path}", "run", "job")
    [back] = pipeline.routed_experts(pipeline.read_rollouts(url))
    assert back.dtype == np.uint8 and back.shape == want.shape
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(canonical_routed_experts(routed), want)
    with pytest.raises(ContractViolation, match=r"expected \[rows, layers, top_k\]"):
        canonical_routed_experts(routed.reshape(-1))


def test_hf_rows_store_ascending_ids_per_position_and_layer(moe: HFEngine) -> None:
    reqs = [request("hello world", n=3), request("abc", n=2, temperature=0.0).model_copy(update={"id": "r"})]
    outputs = moe.generate(reqs)
    table = build_table(reqs, outputs, _context(moe.description.num_experts))
    stored = pipeline.routed_experts(table)
    engine = [s.routed_experts for samples in outputs for s in samples]
    assert len(stored) == len(engine) == 5
    assert any((np.diff(raw, axis=-1) < 0).any() for raw in engine), "the engine must report some unsorted top-k"
    for got, raw in zip(stored, engine, strict=True):
        assert got is not None and raw is not None and got.shape == raw.shape
        # Increasing along k for every (position, layer): a router's top-k are distinct experts.
        assert (np.diff(got.astype(np.int16), axis=-1) > 0).all()
        np.testing.assert_array_equal(got, np.sort(raw, axis=-1))


def test_worker_writes_routed_experts_end_to_end(
    redis_url: str, redis_client: redis.Redis, tiny_moe_dir: Path, tmp_path: Path
) -> None:
    client = pipeline.connect(redis_url)
    lines = [{"id": f"q{i}", "input_ids": [token_id(c) for c in prompt], "return_routed_experts": True,
              "sampling_params": {"max_new_tokens": 5, "n": 2, "seed": i}}
             for i, prompt in enumerate(["hello", "ab"])]
    batch = client.submit(lines, run="moe", output=f"file://{tmp_path}")
    RolloutWorker(redis_client, HFEngine(tiny_moe_dir)).work(burst=True, with_scheduler=False,
                                                             logging_level="WARNING")
    assert batch.wait(timeout=10).counts["finished"] == len(batch.job_ids)
    table = batch.read()
    assert table.num_rows == 4
    arrays = pipeline.routed_experts(table)
    for row, experts in zip(table.to_pylist(), arrays, strict=True):
        rows = row["prompt_tokens"] + row["completion_tokens"] - 1
        assert experts is not None and experts.shape == (rows, LAYERS, TOP_K)
        assert (np.diff(experts.astype(np.int16), axis=-1) > 0).all()  # stored ascending by the worker
        assert row["routed_experts_shape"] == [rows, LAYERS, TOP_K] and row["routed_experts_start"] == 0
