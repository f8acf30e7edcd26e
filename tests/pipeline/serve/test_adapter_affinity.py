"""Sessions on a LoRA adapter go to a worker that holds it resident: real `pipeline worker --engine
sim` processes (which serve adapters), a real redis-server and the real server over HTTP. A worker
publishes the adapter versions resident on its engine in its registry entry; a new session naming an
adapter goes to the worker holding that version, within the bounded load's slack."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import pipeline
from pipeline.core.broker import registry
from pipeline.read.lineage_rows import turn_rows
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import wait_until


def _entries(conn: redis.Redis) -> dict[str, list[str]]:
    return {w.worker_id: w.adapters for w in registry.live_workers(conn)}


def test_new_sessions_on_an_adapter_go_to_the_worker_that_holds_it(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[[], subprocess.Popen],
        pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])
    client = pipeline.Client(redis_client)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql", seed=1), base=tiny_model_dir)
    sim_workers()
    wait_until(lambda: len(_entries(redis_client)) == 1, timeout=60, what="the first worker")
    client.submit([{"id": "warm", "input_ids": [1, 2, 3], "adapter": "sql"}], run="warm",
                  output=f"file://{tmp_path}/warm").wait(timeout=60)
    wait_until(lambda: list(_entries(redis_client).values()) == [["sql@v1"]], timeout=30,
               what="the first worker's entry naming sql@v1 resident")
    [holder] = _entries(redis_client)
    sim_workers()
    wait_until(lambda: len(_entries(redis_client)) == 2, timeout=60, what="the second worker")
    assert _entries(redis_client)[holder] == ["sql@v1"] and [] in _entries(redis_client).values()

    stack = serve(tokenizer=None)
    sessions = [stack.session(adapter="sql") for _ in range(3)]
    for session in sessions:  # one after another: the holder takes each while within the slack (2) of the other
        answer = httpx.post(f"{stack.url}/sessions/{session}/v1/completions", timeout=60,
                            json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 8})
        assert answer.status_code == 200, answer.text
    rows = turn_rows(stack.run, redis_client).to_pylist()
    assert sorted(r["session_id"] for r in rows) == sorted(sessions)
    assert {r["worker_id"] for r in rows} == {holder}
