"""Engine outputs to shard rows: apply the contracts and build one Arrow table per job."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.adapters import split_pinned
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from schemas.shard import shard_schema
from workers.engines.base import SampleOutput
from workers.errors import ContractViolation
from workers.rows.contracts import (
    check_sample,
    resolve_finish,
    token_adapter_segments,
    token_version_segments,
    trim_stop_text,
)


@dataclass(frozen=True)
class RowContext:
    """What every row of a job shares."""

    run: str
    job_id: str
    engine: str
    model: str
    worker_id: str
    weight_version: int  # the version serving when the job started (each row keeps its own tokens' versions)
    submitted_at: datetime
    started_at: datetime
    finished_at: datetime
    num_experts: int | None = None
    # Agent turns, one per request: session, turn index and prefix break (null columns otherwise).
    turns: Sequence[TurnTag] | None = None


def _routed_type(num_experts: int | None) -> pa.DataType:
    return pa.uint8() if num_experts is not None and num_experts <= 256 else pa.uint16()


def canonical_routed_experts(routed: np.ndarray, *, who: str = "engine") -> np.ndarray:
    """The stored form of routed experts: `[rows, layers, top_k]` with each (position, layer)'s
    top-k expert ids in ascending id order — the set the router chose; score order is not kept.

    Every engine's output goes through here (`build_table`), so the column is the same whatever
    the engine. Why the order can go:
    - Routing replay uses the set. Megatron's `RouterReplay.get_replay_topk`
      (`megatron/core/transformer/moe/router_replay.py`, REPLAY_FORWARD/REPLAY_BACKWARD) and
      verl's `_patched_topk_routing_with_score_function` (`verl/utils/megatron/router_replay_patch.py`)
      take the replayed indices, gather the trainer's own scores at them
      (`probs = scores.gather(1, top_indices)`), and scatter both into dense `[tokens, experts]`
      `routing_probs` / `routing_map`: a permutation of the k ids within a row gives the same result.
    - SGLang does not keep score order anyway: its capturer records `topk_ids` as the selection
      returned them (`_post_process_topk_ids` in `python/sglang/srt/layers/moe/topk.py`), and
      `grouped_topk_gpu`, `biased_grouped_topk_impl`, `biased_topk_impl`,
      `kimi_k2_biased_topk_impl`, `fused_topk_softmax_torch_raw_logits` and the biased branch of
      `fused_topk_torch_native` call `torch.topk(..., sorted=False)` (sorted only with fused
      shared experts). Some paths do return score order (the unbiased `fused_topk_torch_native`,
      torch.topk's default), the rest are kernels (`topk_softmax`, `moe_fused_gate`, …) whose
      order is their own: a consumer cannot rely on score order from SGLang.
    What the sort buys is one meaning for every engine: the same routing decision gives the same
    row from hf (score order) and SGLang (often not). It does not make the column smaller (0.3 %,
    `benchmarks/routed_experts.py`: byte-stream split + zstd code the ids order-0). One vectorised
    sort, no per-token Python; raises `ContractViolation` if the array is not 3-D.
    """
    array = np.asarray(routed)
    if array.ndim != 3:
        raise ContractViolation(f"{who}: routed_experts has shape {list(array.shape)}, expected [rows, layers, top_k]")
    return np.sort(array, axis=-1)


def build_table(
    requests: Sequence[RolloutRequest], outputs: Sequence[Sequence[SampleOutput]], ctx: RowContext
) -> pa.Table:
    """One row per sample; raises `ContractViolation` before any row is built if one is bad.

    Columnar: the contracts are checked per sample, then each token column is one
    concatenation and one offsets array, not a Python object per token.
    """
    if len(outputs) != len(requests):
        raise ContractViolation(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
    per_row: list[tuple[Any, ...]] = []  # one tuple a row, in `_PER_ROW`'s order
    prompts: list[np.ndarray] = []
    completions: list[np.ndarray] = []
    logprobs: list[np.ndarray | None] = []
    routed_rows: list[np.ndarray | None] = []
    any_routed = False
    turns: Sequence[TurnTag | None] = ctx.turns if ctx.turns is not None else [None] * len(requests)
    if len(turns) != len(requests):
        raise ContractViolation(f"{len(turns)} agent turns for {len(requests)} requests")
    for request, samples, turn in zip(requests, outputs, turns, strict=True):
        params = request.sampling_params
        if len(samples) != params.n:
            raise ContractViolation(f"request {request.id!r}: {len(samples)} samples for n={params.n}")
        metadata = json.dumps(request.metadata, separators=(",", ":"), ensure_ascii=False)
        prompt = np.asarray(request.input_ids, dtype=np.int32)
        adapter = split_pinned(request.adapter)[0] if request.adapter else None
        for index, sample in enumerate(samples):
            check_sample(request, sample)
            segments = token_version_segments(request, sample, ctx.weight_version)
            adapter_segments = token_adapter_segments(request, sample)
            stop = resolve_finish(request, sample.finish)
            routed = sample.routed_experts if request.return_routed_experts else None
            tokens = np.asarray(sample.token_ids, dtype=np.int32)
            prompts.append(prompt)
            completions.append(tokens)
            logprobs.append(np.asarray(sample.logprobs, dtype=np.float32) if request.logprobs is not None else None)
            top = (
                [[{"token_id": t, "logprob": lp} for t, lp in pos] for pos in sample.top_logprobs]
                if request.logprobs and sample.top_logprobs is not None
                else None
            )
            prompt_lp = sample.prompt_logprobs if request.prompt_logprobs is not None else None
            any_routed |= routed is not None
            routed_rows.append(
                None if routed is None else canonical_routed_experts(routed, who=f"request {request.id!r}"))
            per_row.append((
                f"{request.id}:{index}", request.id, index, top, prompt_lp,
                trim_stop_text(sample.text, stop.stop_reason_text, params.no_stop_trim),
                stop.finish_reason, stop.stop_reason_text, stop.stop_reason_token,
                None if routed is None else sample.routed_experts_start,
                params.temperature, params.top_p, params.top_k, params.min_p, params.seed, params.max_new_tokens,
                params.frequency_penalty, params.presence_penalty, params.repetition_penalty, params.min_new_tokens,
                len(request.input_ids), len(tokens), sample.cached_tokens, metadata, request.prompt_text,
                min(v for _, v in segments),
                None if len(segments) == 1 else [{"start": a, "version": v} for a, v in segments],
                sample.resumed_at or None, adapter,
                None if adapter_segments is None else min(v for _, v in adapter_segments),
                None if adapter_segments is None or len(adapter_segments) == 1
                else [{"start": a, "version": v} for a, v in adapter_segments],
                None if turn is None else turn.session_id, None if turn is None else turn.turn,
                None if turn is None else turn.prefix_break,
                None if turn is None else turn.parent_turn, None if turn is None else turn.parent_sample,
            ))
    rows = len(completions)
    routed_type = _routed_type(ctx.num_experts)
    schema = shard_schema(routed_type)
    arrays: dict[str, pa.Array] = {
        "prompt_token_ids": _list_array(prompts, pa.int32()),
        "completion_token_ids": _list_array(completions, pa.int32()),
        "completion_logprobs": _list_array(logprobs, pa.float32()),
    }
    # The per-row columns in one conversion (a struct array's children): one call into Arrow, not
    # one a column (about twice as fast for one-turn jobs of agent turns, the same for large jobs).
    converted = pa.array(per_row, type=_per_row_type(routed_type)).flatten()
    arrays.update(zip(_PER_ROW, converted, strict=True))
    if any_routed:
        arrays["routed_experts"] = pa.array(
            [None if r is None else r.reshape(-1) for r in routed_rows], type=schema.field("routed_experts").type)
        arrays["routed_experts_shape"] = pa.array(
            [None if r is None else list(r.shape) for r in routed_rows], type=pa.list_(pa.int32()))
    else:
        arrays["routed_experts"] = pa.nulls(rows, schema.field("routed_experts").type)
        arrays["routed_experts_shape"] = pa.nulls(rows, pa.list_(pa.int32()))
    constants = {
        "run": ctx.run, "job_id": ctx.job_id, "engine": ctx.engine, "model": ctx.model, "worker_id": ctx.worker_id,
        "submitted_at": ctx.submitted_at, "started_at": ctx.started_at,
        "finished_at": ctx.finished_at,
    }
    columns = [pa.repeat(pa.scalar(constants[field.name], type=field.type), rows) if field.name in constants
               else arrays[field.name] for field in schema]
    table = pa.Table.from_arrays(columns, schema=schema)
    for field, column in zip(schema, columns, strict=True):
        if not field.nullable and column.null_count:
            raise ContractViolation(f"column {field.name} has nulls")
    return table


# Columns built from one Python value per row, in the order `build_table` produces them.
_PER_ROW = (
    "rollout_id", "request_id", "sample_index", "completion_top_logprobs", "prompt_logprobs", "completion_text",
    "finish_reason", "stop_reason_text", "stop_reason_token", "routed_experts_start",
    "temperature", "top_p", "top_k", "min_p", "seed", "max_new_tokens",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "prompt_tokens", "completion_tokens", "cached_tokens", "metadata", "prompt_text",
    "weight_version", "weight_version_segments", "resumed_at", "adapter", "adapter_version", "adapter_version_segments",
    "session_id", "turn", "prefix_break", "parent_turn", "parent_sample",
)


@functools.cache
def _per_row_type(routed_type: pa.DataType) -> pa.StructType:
    """The per-row columns as one struct, each field nullable (`build_table` checks the nulls)."""
    schema = shard_schema(routed_type)
    return pa.struct([schema.field(name).with_nullable(True) for name in _PER_ROW])


def _list_array(rows: list[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """One list per row from numpy arrays (None: a null row), by a single concatenation."""
    lengths = np.fromiter((0 if r is None else len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [r for r in rows if r is not None]
    dtype = value_type.to_pandas_dtype()
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype=dtype)
    mask = None if len(present) == len(rows) else pa.array([r is None for r in rows], type=pa.bool_())
    # Typed: Arrow infers an int32 array's type slowly (~90 µs, against 1.5 typed; pyarrow 26).
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values, type=value_type), mask=mask)


def utc_from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
