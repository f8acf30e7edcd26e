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


def shard_url(output: str, run: str, job_id: str) -> str:
    return join(output, run, f"{job_id}.parquet")


def encode(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=COMPRESSION, write_statistics=True)
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
