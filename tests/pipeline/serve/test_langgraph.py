"""LangChain's `ChatOpenAI` and LangGraph's prebuilt ReAct agent against `pipeline serve`, joined to a
session by their base URL: tool calls come back as LangChain tool calls, the agent runs the tool and
reaches its final answer, and the session's trajectory is exact (history replayed without a prefix
break)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import redis

from pipeline.read.lineage_rows import turn_rows
from tests.pipeline.serve.conftest import Script, exact_trajectory, run_agent

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """LangSmith traces only when told to; make sure it is not, and no base URL leaks in."""
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("LANGCHAIN_TRACING_V2", "false")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def _llm(url: str, session_id: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="tiny-tools", base_url=f"{url}/sessions/{session_id}/v1", api_key="x", max_retries=0,
                      temperature=0)


def _add_tool(calls: list[tuple[int, int]]) -> Any:
    from langchain_core.tools import tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    return add


def test_create_react_agent_calls_the_tool_and_answers(redis_client: redis.Redis, serve: Any,
                                                       tools_tokenizer: Any) -> None:
    from langchain_core.messages import AIMessage, ToolMessage

    with warnings.catch_warnings():  # deprecated in favour of langchain.agents.create_agent
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    script = Script(tools_tokenizer, {0: f"Let me add.{CALL}", 1: "2 + 3 = 5.", 2: "1 + 1 = 2."})
    stack = serve()
    sid = stack.session(metadata={"client": "langgraph"})
    calls: list[tuple[int, int]] = []
    got: dict[str, Any] = {}

    def agent() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = create_react_agent(_llm(stack.url, sid), [_add_tool(calls)])
        got["out"] = graph.invoke({"messages": [("system", "You add with the add tool."),
                                                ("user", "What is 2 + 3?")]})
        # The conversation goes on: the whole history, replayed, and a new question.
        got["more"] = graph.invoke({"messages": [*got["out"]["messages"], ("user", "And 1 + 1?")]})

    run_agent(redis_client, script.engine(), agent)
    messages = got["out"]["messages"]
    assert calls == [(2, 3)]
    assert [type(m).__name__ for m in messages] == ["SystemMessage", "HumanMessage", "AIMessage", "ToolMessage",
                                                    "AIMessage"]
    assert messages[2].content == "Let me add."
    assert [(c["name"], c["args"]) for c in messages[2].tool_calls] == [("add", {"a": 2, "b": 3})]
    assert isinstance(messages[3], ToolMessage) and messages[3].content == "5"
    assert messages[3].tool_call_id == messages[2].tool_calls[0]["id"]
    final = messages[-1]
    assert isinstance(final, AIMessage) and final.content == "2 + 3 = 5." and not final.tool_calls
    assert final.response_metadata["finish_reason"] == "stop"
    assert got["more"]["messages"][-1].content == "1 + 1 = 2." and len(got["more"]["messages"]) == 7
    assert [request.id for request in script.seen] == [f"{sid}:{turn}" for turn in range(3)]
    item = exact_trajectory(redis_client, stack.run, sid, 3)
    text = tools_tokenizer.decode(item["input_ids"], skip_special_tokens=False)
    # The sampled call verbatim, the tool's result, the answer; then (the template puts the tools before
    # the last user message) the tools again, the new question and its answer.
    assert f"<|user|>What is 2 + 3?<|end|>\n<|assistant|>Let me add.{CALL}<|end|>\n<|tool|>5<|end|>\n" \
           "<|assistant|>2 + 3 = 5.<|end|>\n<tools>" in text
    assert text.endswith("</tools>\n<|user|>And 1 + 1?<|end|>\n<|assistant|>1 + 1 = 2.<|end|>")


def test_bind_tools_invoke_returns_tool_calls(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: CALL})
    stack = serve()
    sid = stack.session()
    got: dict[str, Any] = {}

    def agent() -> None:
        got["reply"] = _llm(stack.url, sid).bind_tools([_add_tool([])]).invoke("What is 2 + 3?")

    run_agent(redis_client, script.engine(), agent)
    reply = got["reply"]
    assert reply.content == ""
    assert [(c["name"], c["args"], c["type"]) for c in reply.tool_calls] == [("add", {"a": 2, "b": 3}, "tool_call")]
    assert reply.tool_calls[0]["id"].startswith("call_") and not reply.invalid_tool_calls
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    (row,) = turn_rows(stack.run, redis_client).to_pylist()
    assert reply.usage_metadata == {"input_tokens": len(row["prompt_token_ids"]),
                                    "output_tokens": len(row["completion_token_ids"]),
                                    "total_tokens": len(row["prompt_token_ids"]) + len(row["completion_token_ids"]),
                                    "input_token_details": {"cache_read": 0}, "output_token_details": {}}
    exact_trajectory(redis_client, stack.run, sid, 1)
