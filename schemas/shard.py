"""The Arrow schema of a shard row (one row per sample) and the shard file metadata."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1"

TOP_LOGPROB = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
TIMESTAMP = pa.timestamp("ms", tz="UTC")


def values_of(kind: pa.DataType) -> pa.ListType:
    """A list whose elements are never null (token ids, logprobs): Parquet stores the element as
    `required`, so readers decode one definition level fewer per token (~25% faster reads)."""
    return pa.list_(pa.field("item", kind, nullable=False))


ROW_FIELDS: list[pa.Field] = [
    pa.field("rollout_id", pa.string(), nullable=False),
    pa.field("request_id", pa.string(), nullable=False),
    pa.field("run", pa.string(), nullable=False),
    pa.field("job_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_token_ids", values_of(pa.int32()), nullable=False),
    pa.field("completion_token_ids", values_of(pa.int32()), nullable=False),
    pa.field("completion_logprobs", values_of(pa.float32())),
    pa.field("completion_top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    pa.field("prompt_logprobs", pa.list_(pa.float32())),  # null at the first prompt position
    pa.field("completion_text", pa.string()),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("stop_reason_text", pa.string()),
    pa.field("stop_reason_token", pa.int32()),
    # Flattened [rows, layers, top_k]; uint8 when the model has <= 256 experts, else uint16. Ascending
    # expert ids per (position, layer): the set the router chose; score order is not kept
    # (workers.rows.canonical_routed_experts).
    pa.field("routed_experts", pa.list_(pa.uint16())),
    pa.field("routed_experts_shape", pa.list_(pa.int32())),
    pa.field("routed_experts_start", pa.int32()),
    pa.field("weight_version", pa.int64(), nullable=False),
    pa.field("temperature", pa.float32(), nullable=False),
    pa.field("top_p", pa.float32(), nullable=False),
    pa.field("top_k", pa.int32(), nullable=False),
    pa.field("min_p", pa.float32(), nullable=False),
    pa.field("seed", pa.int64()),
    pa.field("max_new_tokens", pa.int32(), nullable=False),
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("cached_tokens", pa.int32(), nullable=False),
    pa.field("engine", pa.string(), nullable=False),
    pa.field("model", pa.string(), nullable=False),
    pa.field("worker_id", pa.string(), nullable=False),
    pa.field("submitted_at", TIMESTAMP, nullable=False),
    pa.field("started_at", TIMESTAMP, nullable=False),
    pa.field("finished_at", TIMESTAMP, nullable=False),
    pa.field("metadata", pa.string(), nullable=False),
    # The rendered chat/prompt text for inspection; null for token-id requests.
    pa.field("prompt_text", pa.string()),
]


def shard_schema(routed_experts_type: pa.DataType | None = None) -> pa.Schema:
    """The shard schema with file metadata; routed experts in the given unsigned type (uint16)."""
    routed_experts_type = routed_experts_type or pa.uint16()
    fields = [
        pa.field("routed_experts", pa.list_(routed_experts_type)) if f.name == "routed_experts" else f
        for f in ROW_FIELDS
    ]
    return pa.schema(fields, metadata={"schema_version": SCHEMA_VERSION})


SHARD_SCHEMA = shard_schema()
