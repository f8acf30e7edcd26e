"""Reading shards: run directories, projection, pushed-down filters, dedupe through the commit
log, and the shards read unchanged by Hugging Face datasets, pandas and polars."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import redis

from pipeline.cli.main import main
from pipeline.core.broker import commit_log, keys
from pipeline.core.errors import NoShardsError, PipelineError
from pipeline.core.shards import (
    all_of,
    finish_reason_in,
    read_rollouts,
    request_id_in,
    rollouts_dataset,
    weight_version_between,
)
from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.rows.shard_writer import write_shard
from workers.rows.table import RowContext, build_table

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "step-1"


def job_table(job_id: str, weight_version: int, requests: int = 3, n: int = 2, seed: int = 0) -> pa.Table:
    """A job's shard rows through the workers' own row builder; finish alternates stop/length."""
    rng = np.random.default_rng(seed)
    reqs, outputs = [], []
    for r in range(requests):
        reqs.append(RolloutRequest.model_validate({
            "id": f"{job_id}-q{r}", "input_ids": [1, 2, 3 + r],
            "sampling_params": {"max_new_tokens": 8, "n": n}, "logprobs": 0,
        }))
        samples = []
        for i in range(n):
            length = int(rng.integers(1, 8))
            samples.append(SampleOutput(
                token_ids=rng.integers(5, 50, length).astype(np.int32),
                finish=Finish("stop", matched=0) if i % 2 else Finish("length"),
                logprobs=-rng.random(length).astype(np.float32),
            ))
        outputs.append(samples)
    ctx = RowContext(run=RUN, job_id=job_id, engine="test", model="m", worker_id="w",
                     weight_version=weight_version, submitted_at=NOW, started_at=NOW, finished_at=NOW)
    return build_table(reqs, outputs, ctx)


def write_job(output: str, job_id: str, weight_version: int, seed: int = 0) -> tuple[str, pa.Table]:
    table = job_table(job_id, weight_version, seed=seed)
    return write_shard(table, output, RUN, job_id), table


@pytest.fixture
def shards(tmp_path: Path) -> tuple[str, dict[str, pa.Table]]:
    output = str(tmp_path / "out")
    tables = {}
    for index in range(3):
        job_id = f"b-{index:05d}"
        _, tables[job_id] = write_job(output, job_id, weight_version=index + 1, seed=index)
    return output, tables


def sort_rows(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: r["rollout_id"])


def test_reads_a_run_from_its_output_root_with_projection(shards: tuple[str, dict[str, pa.Table]]) -> None:
    output, tables = shards
    table = read_rollouts(output, run=RUN)
    assert sort_rows(table) == sort_rows(pa.concat_tables(tables.values()))
    projected = read_rollouts(output, run=RUN, columns=["rollout_id", "weight_version"])
    assert projected.column_names == ["rollout_id", "weight_version"]
    assert projected.num_rows == table.num_rows
    assert read_rollouts(output, run="no-such-run", missing_ok=True).num_rows == 0


def test_a_run_or_url_with_no_shards_is_an_error_naming_what_is_there(
    shards: tuple[str, dict[str, pa.Table]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    output, _ = shards
    typo = "stpe-1"
    with pytest.raises(NoShardsError) as info:
        read_rollouts(output, run=typo)
    assert f"no shards under {output}/{typo} (run {typo!r} of output {output}): it does not exist; runs there: " \
        f"{RUN}; did you mean {RUN!r}?" == str(info.value)
    with pytest.raises(NoShardsError, match=f"did you mean {RUN!r}"):  # a misspelled URL, the same
        read_rollouts(f"{output}/{typo}")
    with pytest.raises(NoShardsError, match=r"nope\.parquet: it does not exist; entries there: "):
        read_rollouts(f"{output}/{RUN}/nope.parquet")
    with pytest.raises(NoShardsError, match=r"does not exist either"):
        rollouts_dataset(str(tmp_path / "nowhere" / "out"), run=RUN)
    # `pipeline show` says the same on stderr (exit 1) instead of a bare path.
    assert main(["show", f"{output}/{RUN}/nope.parquet"]) == 1
    assert "nope.parquet: it does not exist; entries there: " in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoShardsError, match="exists but holds no"):
        read_rollouts(str(tmp_path / "empty"))


def test_filters_select_the_right_rows(shards: tuple[str, dict[str, pa.Table]]) -> None:
    output, tables = shards
    rows = pa.concat_tables(tables.values()).to_pylist()

    def ids(table: pa.Table) -> set[str]:
        return set(table.column("rollout_id").to_pylist())

    got = read_rollouts(output, run=RUN, filter=weight_version_between(2, 3))
    assert ids(got) == {r["rollout_id"] for r in rows if 2 <= r["weight_version"] <= 3}
    got = read_rollouts(output, run=RUN, filter=weight_version_between(low=3))
    assert ids(got) == {r["rollout_id"] for r in rows if r["weight_version"] >= 3}
    got = read_rollouts(output, run=RUN, filter=weight_version_between(high=1))
    assert ids(got) == {r["rollout_id"] for r in rows if r["weight_version"] <= 1}
    assert read_rollouts(output, run=RUN, filter=weight_version_between()).num_rows == len(rows)

    got = read_rollouts(output, run=RUN, filter=finish_reason_in("stop"))
    assert ids(got) == {r["rollout_id"] for r in rows if r["finish_reason"] == "stop"}
    assert 0 < got.num_rows < len(rows)

    wanted = ["b-00000-q1", "b-00002-q0"]
    got = read_rollouts(output, run=RUN, filter=request_id_in(wanted))
    assert ids(got) == {r["rollout_id"] for r in rows if r["request_id"] in wanted}
    assert got.num_rows == 4

    both = all_of(None, finish_reason_in("length"), weight_version_between(1, 2), None)
    got = read_rollouts(output, run=RUN, filter=both, columns=["rollout_id"])
    assert ids(got) == {
        r["rollout_id"] for r in rows if r["finish_reason"] == "length" and r["weight_version"] <= 2
    }
    assert all_of(None) is None
    with pytest.raises(PipelineError):
        finish_reason_in()


def test_weight_version_filter_is_pushed_down_to_row_group_statistics(
    shards: tuple[str, dict[str, pa.Table]],
) -> None:
    """Shards of other weight versions are pruned from statistics, before reading any data."""
    output, _ = shards
    dataset = rollouts_dataset(output, RUN)
    fragments = list(dataset.get_fragments())
    assert len(fragments) == 3
    kept = [f.subset(filter=weight_version_between(2, 2)) for f in fragments]
    assert sorted(f.num_row_groups for f in kept) == [0, 0, 1]
    kept = [f.subset(filter=request_id_in(["b-00001-q0"])) for f in fragments]
    assert sorted(f.num_row_groups for f in kept) == [0, 0, 1]


def test_dedupes_through_the_commit_log(tmp_path: Path, redis_client: redis.Redis) -> None:
    output = str(tmp_path / "out")
    url_a, table_a = write_job(output, "b-00000", 1, seed=1)
    url_b, _ = write_job(output, "b-00001", 1, seed=2)
    # the retry of job b-00001 rewrote its shard elsewhere and committed again
    url_b2, table_b2 = write_job(str(tmp_path / "elsewhere"), "b-00001", 2, seed=3)
    # a shard written by a worker that died before committing
    write_job(output, "b-00002", 1, seed=4)
    for url, job, table in [(url_a, "b-00000", table_a), (url_b, "b-00001", None),
                            (url_a, "b-00000", table_a), (url_b2, "b-00001", table_b2)]:
        commit_log.append(redis_client, RUN, commit_log.Commit(
            job_id=job, batch_id="b", url=url, rows=0 if table is None else table.num_rows,
            tokens=0, weight_version=1,
        ))
    listed = read_rollouts(output, run=RUN)
    assert listed.num_rows == 3 * table_a.num_rows  # no log: whatever the directory holds
    table = read_rollouts(output, run=RUN, conn=redis_client)
    assert sort_rows(table) == sort_rows(pa.concat_tables([table_a, table_b2]))
    assert pc.count_distinct(table.column("rollout_id")).as_py() == table.num_rows
    with pytest.raises(PipelineError, match="run name"):
        read_rollouts(output, conn=redis_client)


def test_every_reader_takes_a_run_name_as_read_trajectories_does(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`read_rollouts("step-1")` is the run's committed rows (its commit log, on `conn` or the default
    Redis), not a path of that name; the same for `rollouts_dataset`; a misspelled run says "did you mean"."""
    url, table = write_job(str(tmp_path / "out"), "b-00000", 1, seed=1)
    write_job(str(tmp_path / "out"), "b-00001", 1, seed=2)  # never committed: not the run's
    commit_log.append(redis_client, RUN, commit_log.Commit(job_id="b-00000", batch_id="b", url=url,
                                                           rows=table.num_rows, tokens=0, weight_version=1))
    redis_client.sadd(keys.pool(None).runs, RUN)
    assert sort_rows(read_rollouts(RUN, conn=redis_client)) == sort_rows(table)
    assert rollouts_dataset(RUN, conn=redis_client).count_rows() == table.num_rows
    monkeypatch.setenv("PIPELINE_REDIS_URL", redis_url)
    monkeypatch.chdir(tmp_path)
    assert sort_rows(read_rollouts(RUN)) == sort_rows(table)
    with pytest.raises(NoShardsError, match=f"did you mean {RUN!r}"):
        read_rollouts("step-2")


def test_run_totals_count_each_job_once_at_its_latest_commit(redis_client: redis.Redis) -> None:
    def commit(job: str, rows: int, version: int) -> None:
        commit_log.append(redis_client, "totals", commit_log.Commit(
            job_id=job, batch_id="b", url=f"file:///x/{job}", rows=rows, tokens=rows * 10, weight_version=version))

    commit("j0", 4, 1)
    commit("j1", 0, 1)
    commit("j2", 3, 2)
    commit("j0", 5, 3)  # j0 re-run on newer weights: its v1 commit no longer counts
    assert commit_log.totals(redis_client, "totals") == commit_log.RunTotals(3, 8, 80, [1, 2, 3])
    commit("j1", 2, 3)  # the last v1 job moves on too
    assert commit_log.totals(redis_client, "totals") == commit_log.RunTotals(3, 10, 100, [2, 3])
    # What the stream says, deduplicated, agrees; a run committed before totals existed reads that.
    redis_client.delete(keys.run_totals("totals"))
    assert commit_log.totals(redis_client, "totals") == commit_log.RunTotals(3, 10, 100, [2, 3])


def test_reads_from_an_fsspec_memory_url() -> None:
    output = "memory://reader-test/out"
    url, table = write_job(output, "m-00000", 4)
    assert url.startswith("memory://")
    assert sort_rows(read_rollouts(output, run=RUN)) == sort_rows(table)
    assert sort_rows(read_rollouts([url])) == sort_rows(table)


def shard_files(output: str) -> list[str]:
    return sorted(str(p) for p in Path(output, RUN).glob("*.parquet"))


def test_hugging_face_datasets_loads_shards_unchanged(
    shards: tuple[str, dict[str, pa.Table]], tmp_path: Path
) -> None:
    import datasets

    output, tables = shards
    expected = sort_rows(pa.concat_tables(tables.values()))
    ds = datasets.load_dataset(
        "parquet", data_files=shard_files(output), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert ds.num_rows == len(expected)
    assert set(ds.column_names) == {f.name for f in tables["b-00000"].schema}
    rows = sorted(ds, key=lambda r: r["rollout_id"])
    for got, want in zip(rows, expected, strict=True):
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["completion_token_ids"] == want["completion_token_ids"]
        assert got["completion_logprobs"] == pytest.approx(want["completion_logprobs"])
        assert got["finish_reason"] == want["finish_reason"]
        assert got["weight_version"] == want["weight_version"]


def test_pandas_and_polars_read_shards(shards: tuple[str, dict[str, pa.Table]]) -> None:
    import pandas as pd
    import polars as pl

    output, tables = shards
    expected = sort_rows(pa.concat_tables(tables.values()))
    files = shard_files(output)

    frame = pd.concat([pd.read_parquet(f) for f in files]).sort_values("rollout_id")
    assert frame["rollout_id"].tolist() == [r["rollout_id"] for r in expected]
    assert [list(v) for v in frame["completion_token_ids"]] == [r["completion_token_ids"] for r in expected]
    assert frame["weight_version"].tolist() == [r["weight_version"] for r in expected]

    lazy = pl.scan_parquet(files).filter(pl.col("finish_reason") == "stop").sort("rollout_id")
    polars_rows = lazy.select("rollout_id", "completion_token_ids").collect().to_dicts()
    assert polars_rows == [
        {"rollout_id": r["rollout_id"], "completion_token_ids": r["completion_token_ids"]}
        for r in expected if r["finish_reason"] == "stop"
    ]
