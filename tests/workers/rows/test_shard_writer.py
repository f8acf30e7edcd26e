"""Shards: one per job at a deterministic path, zstd, schema_version, atomic, nothing on failure."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.shards import read_rollouts
from schemas.request import RolloutRequest
from schemas.shard import SCHEMA_VERSION
from tests.helpers.processes import FlakyStore
from workers.engines.base import Finish, SampleOutput
from workers.errors import ShardWriteError
from workers.rows.shard_writer import WriteRetry, write_shard
from workers.rows.table import RowContext, build_table

FAST = WriteRetry(within_s=5.0, backoff_s=0.001, max_backoff_s=0.002)


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
    with pytest.raises(ShardWriteError, match=r"could not write shard .*attempt\(s\)"):
        write_shard(table(), str(tmp_path), "run", "job", retry=WriteRetry(within_s=0.05, backoff_s=0.01))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def read_back(url: str) -> int:
    with fsspec.open(url, "rb") as handle:
        return pq.read_table(handle).num_rows


@pytest.fixture
def flaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type[FlakyStore]:
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setenv("PIPELINE_SPILL_DIR", str(spill))
    return FlakyStore.install(failures=0, spill_dir=spill)


def test_a_failing_write_is_retried_and_the_rows_kept_in_memory(flaky: type[FlakyStore]) -> None:
    flaky.failures = 2
    url = write_shard(table(), "flakystore://bucket", "run", "job", retry=FAST)
    assert url == "flakystore://bucket/run/job.parquet"
    assert flaky.attempts == [[], [], []]  # small: never spilled
    assert read_back("flakystore://bucket/run/job.parquet") == 3


def test_a_large_shard_is_spilled_to_local_disk_while_storage_is_down(
    flaky: type[FlakyStore], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPELINE_SHARD_SPILL_BYTES", "0")  # every shard counts as large
    flaky.failures = 2
    url = write_shard(table(), "flakystore://bucket", "run", "job", retry=FAST)
    [first, second, third] = flaky.attempts
    assert first == [] and len(second) == 1 and second == third  # spilled after the first failure
    assert list(flaky.spill_dir.iterdir()) == []  # and removed once written
    assert read_back(url) == 3


def test_storage_that_stays_down_fails_with_the_reason_and_leaves_nothing(
    flaky: type[FlakyStore], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPELINE_SHARD_SPILL_BYTES", "0")
    flaky.failures = 10**6
    with pytest.raises(ShardWriteError, match="503 Slow Down") as caught:
        write_shard(table(), "flakystore://bucket", "run", "job", retry=WriteRetry(within_s=0.2, backoff_s=0.01))
    assert len(flaky.attempts) >= 3 and f"{len(flaky.attempts)} attempt(s)" in str(caught.value)
    assert list(flaky.spill_dir.iterdir()) == [] and not flaky().exists("flakystore://bucket/run/job.parquet")
