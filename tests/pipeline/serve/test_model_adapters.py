"""An OpenAI call's `model` names the LoRA adapter it runs on (vLLM's convention): real `pipeline worker
--engine sim` processes (which serve adapters), a real redis-server, the real server over HTTP and the
`openai` SDK. A harness can then run each sub-agent on its own adapter within one session; a name a
letter off an adapter's is refused, never served by the base weights."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

import pipeline
from pipeline.core.broker import registry
from pipeline.read.lineage_rows import turn_rows
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import wait_until

BASE = "rollout-pipeline"  # the served model's name of a server without a tokenizer


@pytest.fixture
def stack(serve: Any, redis_client: redis.Redis, sim_workers: Callable[[], subprocess.Popen],
          pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> Any:
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])
    client = pipeline.Client(redis_client)
    for seed, name in enumerate(("sql", "math"), start=1):
        client.push_adapter(name, build_adapter(tiny_model_dir, tmp_path / name, seed=seed), base=tiny_model_dir)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql2", seed=3), base=tiny_model_dir)
    sim_workers()
    wait_until(lambda: registry.live_workers(redis_client), timeout=60, what="a worker")
    return serve(tokenizer=None)


def _api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def test_a_calls_model_selects_the_adapter_else_the_sessions_own(stack: Any, redis_client: redis.Redis) -> None:
    models = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [
        (BASE, None, None), ("math", BASE, "math@v1"), ("sql", BASE, "sql@v2")]

    session = stack.session(adapter="math")
    api = _api(f"{stack.url}/sessions/{session}/v1")
    named = ["sql", BASE, "gpt-4o"]  # an adapter, the served model, a harness's fixed name
    answers = [api.completions.create(model=model, prompt=[5, 6, 7], max_tokens=8) for model in named]
    alone = [_api(f"{stack.url}/v1").completions.create(model=model, prompt=[5, 6, 7], max_tokens=8)
             for model in ("sql", BASE)]

    assert [a.model for a in answers + alone] == ["sql", BASE, BASE, "sql", BASE]
    rows = turn_rows(stack.run, redis_client).to_pylist()
    mine = sorted((r["turn"], r["adapter"], r["adapter_version"]) for r in rows if r["session_id"] == session)
    assert mine == [(0, "sql", 2), (1, "math", 1), (2, "math", 1)]  # else the session's adapter
    others = {r["session_id"]: (r["adapter"], r["adapter_version"]) for r in rows if r["session_id"] != session}
    assert len(others) == 2 and set(others.values()) == {("sql", 2), (None, None)}


def test_a_model_a_letter_off_an_adapter_is_refused_and_nothing_runs(stack: Any, redis_client: redis.Redis) -> None:
    session = stack.session()
    with pytest.raises(openai.NotFoundError) as refused:
        _api(f"{stack.url}/sessions/{session}/v1").completions.create(model="sqll", prompt=[5, 6, 7], max_tokens=8)
    assert refused.value.code == "model_not_found"
    assert "did you mean 'sql'?" in refused.value.message and "adapters: math, sql" in refused.value.message
    with pytest.raises(openai.NotFoundError):  # the chat route refuses it alike, before rendering anything
        _api(f"{stack.url}/v1").chat.completions.create(model="mathh", messages=[{"role": "user", "content": "hi"}])

    answer = _api(f"{stack.url}/sessions/{session}/v1").completions.create(model="sql", prompt=[5, 6, 7], max_tokens=8)
    rows = [r for r in turn_rows(stack.run, redis_client).to_pylist() if r["session_id"] == session]
    assert [(r["turn"], r["adapter"]) for r in rows] == [(0, "sql")]  # the refused call took no turn
    assert answer.model == "sql"
