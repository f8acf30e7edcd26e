"""Shards: one per job at a deterministic path, zstd, schema_version, atomic, nothing on failure."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.reader import read_rollouts
from schemas.request import RolloutRequest
from schemas.shard import SCHEMA_VERSION
from workers.engines.base import Finish, SampleOutput
from workers.errors import ShardWriteError
from workers.rows import RowContext, build_table
from workers.shard_writer import write_shard


def table(rows: int = 3):  # type: ignore[no-untyped-def]
    now = datetime.now(UTC)
    requests = [RolloutRequest(id=f"r{i}", input_ids=[1, 2], metadata={"i": i}) for i in range(rows)]
    outputs = [[SampleOutput(token_ids=np.array([5, 6], dtype=np.int32), finish=Finish("length"),
                             logprobs=np.array([-0.5, -1.0], dtype=np.float32), text="ab")] for _ in requests]
    ctx = RowContext(run="run", job_id="job", engine="hf", model="m", worker_id="w", weight_version=3,
                     submitted_at=now, started_at=now, finished_at=now)
    return build_table(requests, outputs, ctx)


def test_local_shard_is_zstd_with_schema_version_and_rewrites_in_place(tmp_path: Path) -> None:
    url = write_shard(table(), f"file://{tmp_path}", "run", "job")
    assert url == f"file://{tmp_path}/run/job.parquet"
    path = tmp_path / "run" / "job.parquet"
    meta = pq.ParquetFile(path)
    assert meta.schema_arrow.metadata[b"schema_version"] == SCHEMA_VERSION.encode()
    assert meta.metadata.row_group(0).column(0).compression == "ZSTD"
    # A retried job rewrites the same path: still one shard, no temporary files left behind.
    write_shard(table(5), str(tmp_path), "run", "job")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["job.parquet"]
    assert read_rollouts(str(tmp_path), "run").num_rows == 5


def test_memory_filesystem(tmp_path: Path) -> None:
    url = write_shard(table(), "memory://shards", "run", "job")
    assert url == "memory://shards/run/job.parquet"
    got = read_rollouts("memory://shards/run")
    assert got.num_rows == 3 and got.column("weight_version").to_pylist() == [3, 3, 3]


def test_write_to_a_file_where_a_directory_belongs_fails_cleanly(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ShardWriteError, match="could not write shard"):
        write_shard(table(), str(tmp_path), "run", "job")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
