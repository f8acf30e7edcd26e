"""Writing one Parquet shard per job, atomically, at a path derived from run and job id.

A retried job rewrites the same path instead of adding a second shard. Local filesystems
get a temporary name and a rename; object stores get a single put.
"""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage import is_local, join, url_to_fs
from workers.errors import ShardWriteError

COMPRESSION = "zstd"

# Routed experts, the largest column by far. Parquet stores uint8/uint16 as INT32: byte-stream
# split puts each byte plane in its own stream (the all-zero high planes vanish), so zstd sees
# the expert ids as plain bytes, which dictionary bit-packing would hide from it
# (benchmarks/routed_experts.py).
ROUTED_EXPERTS_LEAF = "routed_experts.list.element"
ROUTED_EXPERTS_ZSTD_LEVEL = 9


def _leaf_paths(field: pa.Field, prefix: str = "") -> list[str]:
    """Parquet column paths of an Arrow field (compliant nested names: `x.list.element`)."""
    name, kind = prefix + field.name, field.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _leaf_paths(pa.field("element", kind.value_type), name + ".list.")
    if pa.types.is_struct(kind):
        return [path for child in kind for path in _leaf_paths(child, name + ".")]
    return [name]


# Token ids and logprobs: nearly unique values, so no dictionary; byte-stream split lets zstd
# drop the near-constant high bytes of the ids and the exponent bytes of the floats apart from
# the noisy low ones (benchmarks/worker_overhead.py: 7.8 -> 4.7 bytes a completion token).
TOKEN_LEAVES = frozenset({
    "prompt_token_ids.list.element", "completion_token_ids.list.element",
    "completion_logprobs.list.element", "prompt_logprobs.list.element",
})


def write_options(schema: pa.Schema) -> dict:
    """Column-specific `pq.write_table` options: byte-stream split for token ids, logprobs and
    routed experts (no dictionary there), the defaults elsewhere."""
    leaves = [path for field in schema for path in _leaf_paths(field)]
    split = [path for path in leaves if path in TOKEN_LEAVES or path == ROUTED_EXPERTS_LEAF]
    if not split:
        return {}
    options: dict = {
        "use_dictionary": [path for path in leaves if path not in split],
        "column_encoding": dict.fromkeys(split, "BYTE_STREAM_SPLIT"),
    }
    if ROUTED_EXPERTS_LEAF in split:
        options["compression_level"] = {ROUTED_EXPERTS_LEAF: ROUTED_EXPERTS_ZSTD_LEVEL}
    return options


def shard_url(output: str, run: str, job_id: str) -> str:
    return join(output, run, f"{job_id}.parquet")


def encode(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=COMPRESSION, write_statistics=True, **write_options(table.schema))
    return sink.getvalue().to_pybytes()


def write_shard(table: pa.Table, output: str, run: str, job_id: str) -> str:
    """Write the table and return the shard's URL; on failure nothing is left behind."""
    url = shard_url(output, run, job_id)
    fs, path = url_to_fs(url)
    data = encode(table)
    try:
        if is_local(fs):
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            fs.pipe_file(path, data)
    except OSError as exc:
        raise ShardWriteError(f"could not write shard {url}: {exc}") from exc
    return url
