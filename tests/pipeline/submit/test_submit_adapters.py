"""Submit and adapters: a request naming an adapter the pool never had is refused with the names it
has, nothing enqueued; one naming a pushed adapter carries it into its job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.errors import AdapterError
from pipeline.core.jobs.queue import rollout_queue
from schemas.job_payload import JobPayload
from tests.helpers.adapters import build_adapter


def _lines(path: Path, adapters: list[str | None]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": [1, 2, 3], **({"adapter": a} if a else {})})
                            + "\n" for i, a in enumerate(adapters)))
    return path


def test_an_unknown_adapter_is_refused_at_submit_naming_those_that_exist(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client, pool="p")
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "a", seed=1), base=tiny_model_dir)
    with pytest.raises(AdapterError, match=r"request 'r2': adapter 'sqll' was never pushed to pool 'p'; did you "
                                           r"mean 'sql'\? \(adapters: sql\).*nothing was enqueued"):
        client.submit_file(str(_lines(tmp_path / "bad.jsonl", [None, "sql", "sqll"])), output=f"file://{tmp_path}")
    with pytest.raises(AdapterError, match="adapter 'sql' was never pushed to pool 'default'"):
        pipeline.Client(redis_client).submit([{"id": "x", "input_ids": [1], "adapter": "sql"}],
                                             output=f"file://{tmp_path}")
    assert rollout_queue(redis_client, "p").count == 0 and rollout_queue(redis_client, "default").count == 0

    batch = client.submit_file(str(_lines(tmp_path / "good.jsonl", [None, "sql"])), output=f"file://{tmp_path}")
    [job] = rollout_queue(redis_client, "p").get_jobs()
    payload = JobPayload.model_validate(job.args[0])
    requests = payload.unpack(redis_client.get(payload.prompt_key))
    assert [r.adapter for r in requests] == [None, "sql"] and batch.plan.requests == 2


def test_a_datasets_adapter_column_names_each_rows_adapter(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client, pool="p")
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "a", seed=1), base=tiny_model_dir)
    with pytest.raises(AdapterError, match=r"request '1': adapter 'sqll' was never pushed.*did you mean 'sql'"):
        client.submit(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "adapter": ["sql", "sqll"]}),
                      output=f"file://{tmp_path}")
    assert rollout_queue(redis_client, "p").count == 0

    client.submit(pa.table({"prompt_ids": [[1, 2, 3], [4, 5]], "lora": [None, "sql"]}),
                  columns={"input_ids": "prompt_ids", "adapter": "lora"}, output=f"file://{tmp_path}")
    [job] = rollout_queue(redis_client, "p").get_jobs()
    payload = JobPayload.model_validate(job.args[0])
    assert [r.adapter for r in payload.unpack(redis_client.get(payload.prompt_key))] == [None, "sql"]
