"""Writing one Parquet shard per job, atomically, at a path derived from run and job id.

A retried job rewrites the same path instead of adding a second shard. Local filesystems
get a temporary name and a rename; object stores get a single put.

A failed write is retried by itself, with backoff, for `$PIPELINE_SHARD_WRITE_RETRY_S` seconds
(default 60) before the job fails: the generated rows are kept (encoded, in memory; spilled to
a local temporary file while retrying when larger than `$PIPELINE_SHARD_SPILL_BYTES`, default
64 MiB, in `$PIPELINE_SPILL_DIR` or the system's temporary directory), so a storage fault never
sends the batch back to the engine unless storage stays down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core import settings
from pipeline.core.storage import is_local, join, url_to_fs
from workers.errors import ShardWriteError
from workers.runtime.backoff import backoff_s

log = logging.getLogger(__name__)

ENV_RETRY_S = settings.SHARD_WRITE_RETRY_S.name

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


@dataclass(frozen=True)
class WriteRetry:
    """How long a failing shard write is retried, and the backoff between attempts."""

    within_s: float = settings.SHARD_WRITE_RETRY_S.default  # keep trying this long after the first failure
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    @classmethod
    def from_env(cls) -> WriteRetry:
        return cls(within_s=settings.shard_write_retry_s())


class PendingShard:
    """A shard's encoded bytes on their way to storage; spilled to local disk if large while retrying."""

    def __init__(self, url: str, data: bytes) -> None:
        self.url = url
        self.size = len(data)
        self._data: bytes | None = data
        self._spilled: str | None = None

    @classmethod
    def encode(cls, table: pa.Table, output: str, run: str, job_id: str) -> PendingShard:
        return cls(shard_url(output, run, job_id), encode(table))

    @property
    def spilled(self) -> str | None:
        """The local file holding the bytes while they are spilled."""
        return self._spilled

    def data(self) -> bytes:
        if self._data is not None:
            return self._data
        assert self._spilled is not None
        with open(self._spilled, "rb") as handle:
            return handle.read()

    def spill(self) -> None:
        """Move the bytes to a local temporary file (memory is freed until the next attempt)."""
        if self._spilled is not None or self._data is None:
            return
        handle, path = tempfile.mkstemp(prefix="shard-", suffix=".parquet", dir=settings.spill_dir())
        with os.fdopen(handle, "wb") as out:
            out.write(self._data)
        self._spilled, self._data = path, None

    def discard(self) -> None:
        if self._spilled is not None:
            os.unlink(self._spilled)
            self._spilled = None
        self._data = None

    def store(self, retry: WriteRetry | None = None) -> str:
        """Write to `url`, retrying with backoff while storage fails; the URL, or `ShardWriteError`."""
        retry = retry or WriteRetry.from_env()
        spill_over = settings.shard_spill_bytes()
        first_failure: float | None = None
        attempt = 0
        try:
            while True:
                attempt += 1
                try:
                    _put(self.url, self.data())
                    if attempt > 1:
                        log.warning("shard %s written at attempt %d", self.url, attempt)
                    return self.url
                except OSError as exc:
                    moment = time.monotonic()
                    first_failure = first_failure if first_failure is not None else moment
                    left = retry.within_s - (moment - first_failure)
                    delay = min(left, backoff_s(attempt, retry.backoff_s, retry.max_backoff_s))
                    if left <= 0:
                        raise ShardWriteError(
                            f"could not write shard {self.url} ({attempt} attempt(s) over "
                            f"{moment - first_failure:.1f} s; ${ENV_RETRY_S}={retry.within_s:g}): {exc}"
                        ) from exc
                    log.warning("could not write shard %s (attempt %d): %s; retrying in %.2f s",
                                self.url, attempt, exc, delay)
                    if self.size > spill_over:
                        self.spill()
                    time.sleep(delay)
        finally:
            self.discard()


def _put(url: str, data: bytes) -> None:
    """One attempt: atomic on a local filesystem (temporary name, fsync, rename), one put elsewhere."""
    fs, path = url_to_fs(url)
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


def remove_shard(url: str) -> None:
    """Delete a shard that was written but not committed (its job was canceled meanwhile)."""
    fs, path = url_to_fs(url)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def write_shard(table: pa.Table, output: str, run: str, job_id: str, *, retry: WriteRetry | None = None) -> str:
    """Write the table and return the shard's URL; on failure nothing is left behind."""
    return PendingShard.encode(table, output, run, job_id).store(retry)
