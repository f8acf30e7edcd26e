"""An OpenAI call's `model` names the LoRA adapter it runs on (vLLM's convention): a real redis-server,
the real server over HTTP and the `openai` SDK, with real `pipeline worker --engine sim` processes
(which serve adapters), or with openai-agents in front of a scripted model. A harness can then run
each sub-agent on its own adapter within one session; a name a letter off an adapter's is refused,
never served by the base weights."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

import pipeline
from pipeline.core.broker import registry
from pipeline.read.lineage_rows import turn_rows
from schemas.request import RolloutRequest
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import wait_until
from tests.pipeline.serve.conftest import Script, exact_lineages, run_agent
from workers.engines.adapters.cache import AdapterCache
from workers.engines.base import SampleOutput
from workers.engines.fake import FakeEngine

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


class _ScriptedWithAdapters(FakeEngine):
    """A scripted model that serves LoRA adapters: each batch's adapters resident first (the store's
    versions read and checked by the cache, as a real engine's are), none changing what it answers."""

    def __init__(self, script: Script) -> None:
        super().__init__(replies=script.reply, end_ids=[script.tokenizer.eos_token_id])
        self.adapters = AdapterCache(lambda key, record, bits: None, lambda key: None)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        self.adapters.ensure(r.adapter for r in requests if r.adapter is not None)
        return super().generate(requests)


def test_one_lora_per_sub_agent_in_one_openai_agents_session(
        serve: Any, redis_client: redis.Redis, tools_tokenizer: Any, pipeline_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path) -> None:
    """openai-agents: a lead agent on the base weights calls two sub-agents as tools, each an `Agent`
    whose model is an adapter's name. Every call runs on its agent's policy, and the session reads
    back as three lineages, one per policy, each exact against the engine's prompt and sampled ids."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    set_tracing_disabled(True)
    client = pipeline.Client(redis_client)
    for seed, name in enumerate(("researcher", "critic"), start=1):
        client.push_adapter(name, build_adapter(tiny_model_dir, tmp_path / name, seed=seed), base=tiny_model_dir)
    ask_both = ('<tool_call>{"name": "research", "arguments": {"input": "apples"}}</tool_call>'
                '<tool_call>{"name": "critique", "arguments": {"input": "pears"}}</tool_call>')
    policies: dict[str, str | None] = {}

    def model(request: RolloutRequest, prompt: str) -> str:
        policies[request.id] = request.adapter  # as the engine ran it: pinned to a version
        return {"researcher@v1": "Apples are red.", "critic@v1": "Pears are too sweet."}.get(
            request.adapter or "", "Red apples; sweet pears." if "<|tool|>" in prompt else ask_both)

    script = Script(tools_tokenizer, by_request=model)
    stack = serve()
    sid = stack.session()
    got: dict[str, Any] = {}

    async def main() -> None:
        api = AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        on = {name: OpenAIChatCompletionsModel(model=name, openai_client=api)
              for name in ("tiny-tools", "researcher", "critic")}
        researcher = Agent(name="researcher", instructions="Research the topic.", model=on["researcher"])
        critic = Agent(name="critic", instructions="Critique the topic.", model=on["critic"])
        lead = Agent(name="lead", instructions="You lead.", model=on["tiny-tools"],
                     tools=[researcher.as_tool("research", "Research a topic."),
                            critic.as_tool("critique", "Critique a topic.")])
        try:
            got["result"] = await Runner.run(lead, "Apples and pears?")
        finally:
            await api.close()

    run_agent(redis_client, _ScriptedWithAdapters(script), lambda: asyncio.run(main()))
    assert got["result"].final_output == "Red apples; sweet pears."
    assert sorted(policies.values(), key=str) == [None, None, "critic@v1", "researcher@v1"]  # what the engine ran
    lineages = exact_lineages(redis_client, stack.run, sid, script)
    by_policy = {item["adapter"]: item for item in lineages}
    assert sorted(by_policy, key=str) == [None, "critic", "researcher"] and by_policy[None]["turns"] == [0, 3]
    for item in lineages:  # each policy's sampled tokens carry its version; the lead's are the base's
        sampled = {v for v, m in zip(item["token_adapter_version"], item["loss_mask"], strict=True) if m}
        assert sampled == ({-1} if item["adapter"] is None else {1})
