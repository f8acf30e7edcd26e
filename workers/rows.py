"""Engine outputs to shard rows: apply the contracts and build one Arrow table per job."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from schemas.request import RolloutRequest
from schemas.shard import shard_schema
from workers.contracts import check_sample, resolve_finish, trim_stop_text
from workers.engines.base import SampleOutput
from workers.errors import ContractViolation


@dataclass(frozen=True)
class RowContext:
    """What every row of a job shares."""

    run: str
    job_id: str
    engine: str
    model: str
    worker_id: str
    weight_version: int
    submitted_at: datetime
    started_at: datetime
    finished_at: datetime
    num_experts: int | None = None


def _routed_type(num_experts: int | None) -> pa.DataType:
    return pa.uint8() if num_experts is not None and num_experts <= 256 else pa.uint16()


def build_table(
    requests: Sequence[RolloutRequest], outputs: Sequence[Sequence[SampleOutput]], ctx: RowContext
) -> pa.Table:
    """One row per sample; raises `ContractViolation` before any row is built if one is bad."""
    if len(outputs) != len(requests):
        raise ContractViolation(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
    columns: dict[str, list] = {name: [] for name in shard_schema().names}
    for request, samples in zip(requests, outputs, strict=True):
        params = request.sampling_params
        if len(samples) != params.n:
            raise ContractViolation(f"request {request.id!r}: {len(samples)} samples for n={params.n}")
        metadata = json.dumps(request.metadata, separators=(",", ":"), ensure_ascii=False)
        for index, sample in enumerate(samples):
            check_sample(request, sample)
            if sample.weight_version is not None and sample.weight_version != ctx.weight_version:
                raise ContractViolation(
                    f"request {request.id!r}: engine reports weight version {sample.weight_version}, "
                    f"the worker serves {ctx.weight_version}"
                )
            stop = resolve_finish(request, sample.finish)
            routed = sample.routed_experts if request.return_routed_experts else None
            row = {
                "rollout_id": f"{request.id}:{index}",
                "request_id": request.id,
                "run": ctx.run,
                "job_id": ctx.job_id,
                "sample_index": index,
                "prompt_token_ids": request.input_ids,
                "completion_token_ids": np.asarray(sample.token_ids, dtype=np.int32),
                "completion_logprobs": (
                    np.asarray(sample.logprobs, dtype=np.float32) if request.logprobs is not None else None
                ),
                "completion_top_logprobs": (
                    [[{"token_id": t, "logprob": lp} for t, lp in pos] for pos in sample.top_logprobs]
                    if request.logprobs and sample.top_logprobs is not None
                    else None
                ),
                "prompt_logprobs": sample.prompt_logprobs if request.prompt_logprobs is not None else None,
                "completion_text": trim_stop_text(sample.text, stop.stop_reason_text, params.no_stop_trim),
                "finish_reason": stop.finish_reason,
                "stop_reason_text": stop.stop_reason_text,
                "stop_reason_token": stop.stop_reason_token,
                "routed_experts": None if routed is None else np.asarray(routed).reshape(-1),
                "routed_experts_shape": None if routed is None else list(np.asarray(routed).shape),
                "routed_experts_start": None if routed is None else sample.routed_experts_start,
                "weight_version": ctx.weight_version,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "min_p": params.min_p,
                "seed": params.seed,
                "max_new_tokens": params.max_new_tokens,
                "prompt_tokens": len(request.input_ids),
                "completion_tokens": len(sample.token_ids),
                "cached_tokens": sample.cached_tokens,
                "engine": ctx.engine,
                "model": ctx.model,
                "worker_id": ctx.worker_id,
                "submitted_at": ctx.submitted_at,
                "started_at": ctx.started_at,
                "finished_at": ctx.finished_at,
                "metadata": metadata,
            }
            for name, value in row.items():
                columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=shard_schema(_routed_type(ctx.num_experts)))


def utc_from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
