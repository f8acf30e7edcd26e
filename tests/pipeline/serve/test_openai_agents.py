"""The OpenAI Agents SDK (`openai-agents`) against `pipeline serve`: an `Agent` with a function tool
on the chat-completions model, joined to a session by its base URL, runs to its final answer; the
session's trajectory is exact (its history replayed without a prefix break)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from pipeline.core.broker import keys
from tests.pipeline.serve.conftest import Script, exact_trajectory, run_agent

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(autouse=True)
def _no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK exports traces to api.openai.com unless told not to: nothing leaves this machine."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def _agent(url: str, session_id: str, calls: list[tuple[int, int]]) -> tuple[Any, Any]:
    from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = AsyncOpenAI(base_url=f"{url}/sessions/{session_id}/v1", api_key="x", max_retries=0)
    model = OpenAIChatCompletionsModel(model="tiny-tools", openai_client=client)
    return Agent(name="calc", instructions="You add with the add tool.", tools=[add], model=model), client


def test_runner_run_calls_the_tool_and_answers(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    from agents import Runner

    script = Script(tools_tokenizer, {0: f"Let me add.{CALL}", 1: "2 + 3 = 5."})
    stack = serve()
    sid = stack.session(metadata={"client": "openai-agents"})
    calls: list[tuple[int, int]] = []
    got: dict[str, Any] = {}

    async def main() -> None:
        agent, client = _agent(stack.url, sid, calls)
        try:
            got["result"] = await Runner.run(agent, "What is 2 + 3?")
        finally:
            await client.close()

    run_agent(redis_client, script.engine(), lambda: asyncio.run(main()))
    result = got["result"]
    assert result.final_output == "2 + 3 = 5."
    assert calls == [(2, 3)]
    assert [request.id for request in script.seen] == [f"{sid}:0", f"{sid}:1"]
    item = exact_trajectory(redis_client, stack.run, sid, 2)
    assert redis_client.hget(keys.run_turn_stats(stack.run), "prefix_breaks") is None
    # What the trainer reads: the sampled call verbatim, the tool's result, the answer.
    text = tools_tokenizer.decode(item["input_ids"], skip_special_tokens=False)
    assert text.endswith(f"<|assistant|>Let me add.{CALL}<|end|>\n<|tool|>5<|end|>\n<|assistant|>2 + 3 = 5.<|end|>")


def test_runner_run_streamed_then_a_follow_up_run(redis_client: redis.Redis, serve: Any,
                                                  tools_tokenizer: Any) -> None:
    """A streamed run (a content-less tool call, then the answer), then a second run on its
    `to_input_list()` and a new question: three turns, one trajectory."""
    from agents import Runner

    script = Script(tools_tokenizer, {0: CALL, 1: "The sum is 5.", 2: "1 + 1 = 2."})
    stack = serve()
    sid = stack.session()
    calls: list[tuple[int, int]] = []
    got: dict[str, Any] = {"events": []}

    async def main() -> None:
        agent, client = _agent(stack.url, sid, calls)
        try:
            streamed = Runner.run_streamed(agent, "What is 2 + 3?")
            async for event in streamed.stream_events():
                got["events"].append(event.type)
            got["final"] = streamed.final_output
            follow_up = await Runner.run(agent, [*streamed.to_input_list(), {"role": "user", "content": "And 1 + 1?"}])
            got["follow_up"] = follow_up.final_output
        finally:
            await client.close()

    run_agent(redis_client, script.engine(), lambda: asyncio.run(main()))
    assert got["final"] == "The sum is 5." and got["follow_up"] == "1 + 1 = 2."
    assert calls == [(2, 3)]
    assert "raw_response_event" in got["events"] and "run_item_stream_event" in got["events"]
    assert [request.id for request in script.seen] == [f"{sid}:{turn}" for turn in range(3)]
    exact_trajectory(redis_client, stack.run, sid, 3)
