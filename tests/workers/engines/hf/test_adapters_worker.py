"""LoRA adapters on a real `pipeline worker` process (hf engine, peft): one job mixing base requests
and two adapters, each row the greedy tokens of base + its adapter version as peft alone computes
them; a new version taken from the next job; `pipeline verify` recomputing under base + adapter;
a job whose adapter is gone refused and failed, never served by the base weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

import pipeline
from pipeline.core import adapters
from pipeline.core.errors import JobsFailedError
from tests.helpers.adapters import build_adapter, greedy_reference

TOKENS = 6


def _request(i: int, adapter: str | None) -> dict[str, Any]:
    return {"id": f"r{i}", "input_ids": [5 + i, 9, 12 + i][: 2 + i % 2], "adapter": adapter,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": TOKENS, "ignore_eos": True}}


@pytest.fixture
def client(redis_client: redis.Redis, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> pipeline.Client:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the worker's default store too
    return pipeline.Client(redis_client)


def test_one_batch_mixes_base_and_adapters_each_row_base_plus_its_adapter_version(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        start_worker: Any) -> None:
    dirs = {"sql": build_adapter(tiny_model_dir, tmp_path / "sql1", seed=1),
            "math": build_adapter(tiny_model_dir, tmp_path / "math", seed=2, rank=2, targets=("o_proj", "down_proj"))}
    for name, path in dirs.items():
        client.push_adapter(name, path, base=tiny_model_dir)
    start_worker("--max-adapters", "1")  # the job needs two: both stay resident while it runs
    names = [None, "sql", "math", None, "sql", "math"]
    batch = client.submit([_request(i, a) for i, a in enumerate(names)], run="mix", output=f"file://{tmp_path}/out",
                          batch_size=64)
    batch.wait(timeout=120)
    rows = batch.read().sort_by("request_id").to_pylist()
    assert [(r["adapter"], r["adapter_version"]) for r in rows] == [
        (a, None if a is None else 1) for a in names]
    for row in rows:
        expected = greedy_reference(tiny_model_dir, dirs.get(row["adapter"]), row["prompt_token_ids"], TOKENS)
        assert row["completion_token_ids"] == expected, row["rollout_id"]
    base, sql = rows[0], rows[1]
    assert greedy_reference(tiny_model_dir, None, sql["prompt_token_ids"], TOKENS) != sql["completion_token_ids"]
    assert base["completion_token_ids"] != greedy_reference(tiny_model_dir, dirs["sql"], base["prompt_token_ids"],
                                                            TOKENS)

    dirs["sql"] = build_adapter(tiny_model_dir, tmp_path / "sql2", seed=3)
    assert client.push_adapter("sql", dirs["sql"], base=tiny_model_dir).version == 2
    again = client.submit([_request(1, "sql")], run="mix2", output=f"file://{tmp_path}/out")
    again.wait(timeout=120)
    [row] = again.read().to_pylist()
    assert (row["adapter"], row["adapter_version"]) == ("sql", 2)
    assert row["completion_token_ids"] == greedy_reference(tiny_model_dir, dirs["sql"], row["prompt_token_ids"], TOKENS)

    for run in ("mix", "mix2"):  # base + each row's own adapter version, recomputed teacher-forced
        report = pipeline.verify(run, str(tiny_model_dir), conn=redis_client)
        assert report.tokens == TOKENS * (len(names) if run == "mix" else 1)
        assert report.max_abs_diff < 1e-3


def test_a_job_whose_adapter_is_gone_fails_with_the_reason_never_served_by_the_base(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        start_worker: Any) -> None:
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql", seed=1), base=tiny_model_dir)
    batch = client.submit([_request(0, "sql")], run="gone", output=f"file://{tmp_path}/out")
    assert adapters.remove(redis_client, None, "sql")  # lost after the submit took it
    start_worker(env={"PIPELINE_UNSERVABLE_WAIT_S": "0"})
    with pytest.raises(JobsFailedError) as failed:
        batch.wait(timeout=120)
    [reason] = failed.value.failures.values()
    assert "adapter 'sql' was never pushed to pool 'default'" in reason
    assert batch.status().counts["finished"] == 0 and not list((tmp_path / "out").rglob("*.parquet"))
