"""LoRA adapters on a real `pipeline worker --engine sglang-http` against a stand-in SGLang server
launched with `--enable-lora`: a job mixing base requests and two adapters, each adapter materialised
in PEFT format and loaded on the server under its pinned name, each row served with its adapter and
recording its version; an adapter the server lost (a restart) refuses the call, the job is handed
back and served with the adapter loaded again, never by the base."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from safetensors.numpy import load_file

import pipeline
from pipeline.core.errors import JobsFailedError
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import wait_until
from tests.workers.engines.conftest import Standin, launch, stop, wait_ready

PROMPT = [5, 9, 12]


def _request(i: int, adapter: str | None) -> dict[str, Any]:
    return {"id": f"r{i}", "input_ids": PROMPT, "adapter": adapter,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}


@pytest.fixture(params=[True])
def lora_server(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Standin]:
    """A stand-in launched with `--enable-lora` (without, when parametrised False)."""
    server = launch(tiny_model_dir, tmp_path / "standin.log", *(["--enable-lora"] if request.param else []))
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


@pytest.fixture
def client(redis_client: redis.Redis, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
           tiny_model_dir: Path, tmp_path: Path) -> pipeline.Client:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the worker's default store too
    client = pipeline.Client(redis_client)
    for seed, name in enumerate(("sql", "math"), start=1):
        client.push_adapter(name, build_adapter(tiny_model_dir, tmp_path / name, seed=seed), base=tiny_model_dir)
    return client


def _base_tokens(server: Standin) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}
    return httpx.post(f"{server.url}/generate", json=body, timeout=30).json()["output_ids"]


def _loads(server: Standin) -> list[dict[str, Any]]:
    return [body for _, path, body in server.stats()["lifecycle"] if path == "/load_lora_adapter"]


def test_one_job_mixes_base_and_two_adapters_loaded_on_the_server_under_their_versions(
        client: pipeline.Client, lora_server: Standin, start_worker: Any, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "adapters"
    start_worker("--engine", "sglang-http", "--url", lora_server.url, "--adapter-dir", str(adapter_dir),
                 "--max-adapters", "1")  # the job needs two: both stay loaded while it runs
    names = [None, "sql", "math", None, "sql", "math"]
    batch = client.submit([_request(i, a) for i, a in enumerate(names)], run="mix", output=f"file://{tmp_path}/out",
                          batch_size=64)
    batch.wait(timeout=120)
    rows = batch.read().sort_by("request_id").to_pylist()
    assert [(r["adapter"], r["adapter_version"]) for r in rows] == [(a, None if a is None else 1) for a in names]
    assert sorted(b["lora_name"] for b in _loads(lora_server)) == ["math@v1", "sql@v1"]
    for body in _loads(lora_server):  # PEFT directories the server read: the adapter as peft saved it
        path = Path(body["lora_path"])
        name = body["lora_name"].split("@")[0]
        assert path == adapter_dir / body["lora_name"]
        assert json.loads((path / "adapter_config.json").read_text()) == json.loads(
            (tmp_path / name / "adapter_config.json").read_text())
        written, pushed = (load_file(d / "adapter_model.safetensors") for d in (path, tmp_path / name))
        assert sorted(written) == sorted(pushed) and all((written[k] == pushed[k]).all() for k in pushed)
    tokens = {r["adapter"]: r["completion_token_ids"] for r in rows}
    assert all(r["completion_token_ids"] == tokens[r["adapter"]] for r in rows)
    assert tokens[None] == _base_tokens(lora_server)
    assert len({tuple(t) for t in tokens.values()}) == 3  # each adapter served by itself, not the base


def test_an_adapter_the_server_lost_is_handed_back_and_served_loaded_again_never_by_the_base(
        client: pipeline.Client, lora_server: Standin, start_worker: Any, tmp_path: Path) -> None:
    worker = ("--engine", "sglang-http", "--url", lora_server.url, "--adapter-dir", str(tmp_path / "adapters"))
    start_worker(*worker)
    first = client.submit([_request(0, "sql")], run="first", output=f"file://{tmp_path}/first")
    first.wait(timeout=120)
    [served] = first.read().to_pylist()
    assert served["completion_token_ids"] != _base_tokens(lora_server)

    lora_server.faults(forget_loras=True)  # a restart: the server no longer knows sql@v1
    refused_before = lora_server.stats()["http_generate"]
    lost = client.submit([_request(1, "sql")], run="lost", output=f"file://{tmp_path}/lost")
    wait_until(lambda: lora_server.stats()["http_generate"] > refused_before, timeout=60, what="the refused call")
    assert lost.status().counts["finished"] == 0 and not list((tmp_path / "lost").rglob("*.parquet"))

    again = client.submit([_request(2, "sql")], run="again", output=f"file://{tmp_path}/again")
    again.wait(timeout=120)  # the worker that was refused loads the adapter again first
    start_worker(*worker)  # the refused job goes to a worker that did not refuse it
    lost.wait(timeout=120)
    rows = [*again.read().to_pylist(), *lost.read().to_pylist()]
    assert [(r["adapter"], r["adapter_version"]) for r in rows] == [("sql", 1), ("sql", 1)]
    assert all(r["completion_token_ids"] == served["completion_token_ids"] for r in rows)
    assert [b["lora_name"] for b in _loads(lora_server)].count("sql@v1") >= 2


def test_evicting_an_adapter_the_server_lost_does_not_stop_the_next_batch(
        client: pipeline.Client, lora_server: Standin, start_worker: Any, tmp_path: Path) -> None:
    start_worker("--engine", "sglang-http", "--url", lora_server.url, "--adapter-dir", str(tmp_path / "adapters"),
                 "--max-adapters", "1")
    client.submit([_request(0, "sql")], run="sql", output=f"file://{tmp_path}/sql").wait(timeout=120)
    lora_server.faults(forget_loras=True)  # a restart: sql@v1, due for eviction, is gone already
    batch = client.submit([_request(1, "math")], run="math", output=f"file://{tmp_path}/math")
    batch.wait(timeout=120)
    [row] = batch.read().to_pylist()
    assert (row["adapter"], row["adapter_version"]) == ("math", 1)
    unloads = [body for _, path, body in lora_server.stats()["lifecycle"] if path == "/unload_lora_adapter"]
    assert unloads == [{"lora_name": "sql@v1"}] and lora_server.stats()["loras"].keys() == {"math@v1"}


@pytest.mark.parametrize("lora_server", [False], indirect=True)
def test_a_server_without_lora_refuses_the_load_and_the_job_fails_with_why_never_run_on_the_base(
        client: pipeline.Client, lora_server: Standin, start_worker: Any, tmp_path: Path) -> None:
    start_worker("--engine", "sglang-http", "--url", lora_server.url, "--adapter-dir", str(tmp_path / "adapters"),
                 env={"PIPELINE_UNSERVABLE_WAIT_S": "0"})
    batch = client.submit([_request(0, None), _request(1, "sql")], run="nolora", output=f"file://{tmp_path}/out")
    with pytest.raises(JobsFailedError) as failed:
        batch.wait(timeout=120)
    [reason] = failed.value.failures.values()
    assert "adapter sql@v1 does not load on this worker" in reason and "--enable-lora" in reason
    assert lora_server.stats()["http_generate"] == 0 and not list((tmp_path / "out").rglob("*.parquet"))


def test_a_partial_adapter_push_aborts_the_call_and_continues_it_under_the_new_version(
        client: pipeline.Client, lora_server: Standin, redis_client: redis.Redis, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    """A partial push of sql v2 while the worker's call on sql v1 waits on the server: the worker aborts it
    (`/abort_request`), loads v2 on the server and sends the continuation with v2's `lora_path`; the row,
    stopped before its first token, is all v2's (`adapter_version` 2, no segments), never the base's."""
    from tests.workers.rows.test_partial_swap import run_with_push
    from workers.engines.sglang.http_engine import SGLangHTTPEngine

    lora_server.faults(delays={"slow-": 120})  # the first call waits (abortable); the continuation does not
    batch = client.submit([{**_request(0, "sql"), "id": "slow"}], run="partial", output=f"file://{tmp_path}/out")
    v2 = build_adapter(tiny_model_dir, tmp_path / "sql2", seed=5)
    engine = SGLangHTTPEngine([lora_server.url], adapter_dir=tmp_path / "adapters")
    acks = run_with_push(redis_client, engine, "partial", ready=lambda: lora_server.stats()["generate"] >= 1,
                         push_now=lambda: client.push_adapter("sql", v2, base=tiny_model_dir, mode="partial").acks)
    assert [(a["version"], a["mode"], a["detail"]) for a in acks] == [
        (2, "partial", "1 sample(s) stopped, 1 job(s) continued on v2")]
    assert batch.wait(timeout=30).counts["finished"] == 1
    stats = lora_server.stats()
    assert stats["abort_requests"] == [{"rid": stats["rids"][0]}]
    assert [r.split("-")[0] for r in stats["rids"]] == ["slow", "slow+0"]
    assert [b["lora_name"] for b in _loads(lora_server)] == ["sql@v1", "sql@v2"]
    (row,) = batch.read().to_pylist()
    assert (row["adapter"], row["adapter_version"], row["adapter_version_segments"]) == ("sql", 2, None)
    assert row["completion_token_ids"] != _base_tokens(lora_server)
