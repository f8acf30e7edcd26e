"""Real harnesses that do not hold one linear conversation, through `pipeline serve` with no glue: an
openai-agents agent calling two sub-agents as tools in parallel, a LangGraph graph fanning out with
`Send`, a loop that compacts its history into a summary, and a reasoning template that strips earlier
`<think>` blocks under both history modes. Each: the calls the harness made form the tree it made,
and each lineage is exact against the engine's own prompt and sampled ids (`exact_lineages`)."""

from __future__ import annotations

import asyncio
import json
import operator
import shutil
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
import redis

from pipeline.core.broker import keys
from pipeline.read.lineage_rows import turn_rows
from tests.pipeline.serve.conftest import TOKENIZER, Script, exact_lineages, run_agent


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No traces leave this machine (the Agents SDK exports to api.openai.com, LangSmith when told)."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
    monkeypatch.setenv("LANGCHAIN_TRACING_V2", "false")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def _calls(conn: redis.Redis, run: str, session_id: str) -> dict[int, dict[str, Any]]:
    return {r["turn"]: r for r in turn_rows(run, conn).to_pylist() if r["session_id"] == session_id}


def test_openai_agents_sub_agents_as_tools_called_in_parallel(redis_client: redis.Redis, serve: Any,
                                                               tools_tokenizer: Any) -> None:
    """The lead agent asks two sub-agents (`Agent.as_tool`) at once; the SDK runs both tool calls
    concurrently through the same session. Three lineages: the lead's two calls, and each sub-agent's
    call a root of its own; the lead's second call extends its first, whatever came between."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ask_both = ('<tool_call>{"name": "research", "arguments": {"input": "apples"}}</tool_call>'
                '<tool_call>{"name": "critique", "arguments": {"input": "pears"}}</tool_call>')

    def model(prompt: str) -> str:
        if "<|system|>Research" in prompt:
            return "Apples are red."
        if "<|system|>Critique" in prompt:
            return "Pears are too sweet."
        return "Red apples; sweet pears." if "<|tool|>" in prompt else ask_both

    script = Script(tools_tokenizer, by_prompt=model)
    stack = serve()
    sid = stack.session(metadata={"client": "openai-agents", "harness": "agents as tools"})
    got: dict[str, Any] = {}

    async def main() -> None:
        client = AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        llm = OpenAIChatCompletionsModel(model="tiny-tools", openai_client=client)
        researcher = Agent(name="researcher", instructions="Research the topic.", model=llm)
        critic = Agent(name="critic", instructions="Critique the topic.", model=llm)
        lead = Agent(name="lead", instructions="You lead.", model=llm,
                     model_settings=ModelSettings(parallel_tool_calls=True),
                     tools=[researcher.as_tool("research", "Research a topic."),
                            critic.as_tool("critique", "Critique a topic.")])
        try:
            got["result"] = await Runner.run(lead, "Apples and pears?")
        finally:
            await client.close()

    run_agent(redis_client, script.engine(), lambda: asyncio.run(main()))
    assert got["result"].final_output == "Red apples; sweet pears."
    lineages = exact_lineages(redis_client, stack.run, sid, script)
    calls = _calls(redis_client, stack.run, sid)
    lead = [t for t, r in calls.items() if "<|system|>You lead." in tools_tokenizer.decode(r["prompt_token_ids"])]
    assert len(calls) == 4 and lead == [0, 3]
    assert sorted(item["turns"] for item in lineages) == [[0, 3], [1], [2]]
    assert calls[3]["parent_turn"] == 0 and calls[1]["parent_turn"] is None and calls[2]["parent_turn"] is None
    # The lead's last call saw both sub-agents' answers as tool results, after its own sampled calls.
    text = tools_tokenizer.decode(next(i for i in lineages if i["turns"] == [0, 3])["input_ids"])
    assert f"<|assistant|>{ask_both}<|end|>" in text and "Apples are red." in text and "Pears are too sweet." in text


class _Fan(TypedDict):
    topics: list[str]
    plan: str
    notes: Annotated[list[str], operator.add]
    answer: str


def test_langgraph_send_fans_out_to_parallel_workers(redis_client: redis.Redis, serve: Any,
                                                     tools_tokenizer: Any) -> None:
    """A map-reduce graph: `plan` asks the model for topics, `Send` starts one `research` node per topic
    (LangGraph runs them in parallel), `write` goes on from the plan's conversation with the notes."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    def model(prompt: str) -> str:
        if "<|system|>Research" in prompt:
            return f"Notes on {prompt.rsplit('<|user|>', 1)[1].split('<|end|>')[0]}."
        return "Both are fruit." if "Notes:" in prompt else "apples,pears,plums"

    script = Script(tools_tokenizer, by_prompt=model)
    stack = serve()
    sid = stack.session(metadata={"client": "langgraph", "harness": "Send"})
    llm = ChatOpenAI(model="tiny-tools", base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    opening = [SystemMessage("You plan."), HumanMessage("Which fruit?")]

    def plan(state: _Fan) -> dict[str, Any]:
        reply = llm.invoke(opening)
        return {"plan": reply.content, "topics": reply.content.split(",")}

    def research(state: dict[str, str]) -> dict[str, Any]:
        return {"notes": [llm.invoke([SystemMessage("Research it."), HumanMessage(state["topic"])]).content]}

    def write(state: _Fan) -> dict[str, Any]:
        notes = " ".join(sorted(state["notes"]))
        return {"answer": llm.invoke([*opening, AIMessage(state["plan"]), HumanMessage(f"Notes: {notes}")]).content}

    graph = StateGraph(_Fan)
    graph.add_node("plan", plan)
    graph.add_node("research", research)
    graph.add_node("write", write)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", lambda s: [Send("research", {"topic": t}) for t in s["topics"]], ["research"])
    graph.add_edge("research", "write")
    graph.add_edge("write", END)
    app = graph.compile()
    got: dict[str, Any] = {}
    run_agent(redis_client, script.engine(), lambda: got.update(app.invoke({"notes": []})))

    assert got["answer"] == "Both are fruit." and sorted(got["notes"]) == [
        "Notes on apples.", "Notes on pears.", "Notes on plums."]
    lineages = exact_lineages(redis_client, stack.run, sid, script)
    assert sorted(item["turns"] for item in lineages) == [[0, 4], [1], [2], [3]]
    assert _calls(redis_client, stack.run, sid)[4]["parent_turn"] == 0


def test_a_compacting_loop_is_two_lineages(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    """Work, ask for a summary, then start again from the task and the summary (as verifiers'
    summarize_at_tokens or an OpenHands condenser does): the summary call ends the first lineage,
    the restart is a root (counted as a prefix break) and the rest extends it."""
    import httpx
    from openai import OpenAI

    script = Script(tools_tokenizer, {0: "Step one.", 1: "Step two.", 2: "Summary: two steps done.",
                                      3: "Step three.", 4: "Done."})
    stack = serve()
    sid = stack.session(metadata={"harness": "compaction"})

    def agent() -> None:
        client = OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        task = [{"role": "system", "content": "You work in steps."}, {"role": "user", "content": "Do the task."}]
        messages = list(task)
        for ask in ("Go on.", "Summarise what you did.", None):
            reply = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": reply}] + ([{"role": "user", "content": ask}] if ask else [])
        messages = [task[0], {"role": "user", "content": f"Do the task. So far: {reply}"}]
        for ask in ("Go on.", None):
            reply = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
            messages += [{"role": "assistant", "content": reply}] + ([{"role": "user", "content": ask}] if ask else [])
        client.close()

    run_agent(redis_client, script.engine(), agent)
    lineages = exact_lineages(redis_client, stack.run, sid, script)
    assert [item["turns"] for item in lineages] == [[0, 1, 2], [3, 4]]
    assert [r["prefix_break"] for r in _calls(redis_client, stack.run, sid).values()] == [False] * 3 + [True, False]
    assert int(redis_client.hget(keys.run_turn_stats(stack.run), "prefix_breaks")) == 1
    session = httpx.get(f"{stack.url}/sessions/{sid}").json()
    assert session["turns"] == 5 and session["calls_in_flight"] == 0


def test_a_reply_followed_by_more_assistant_messages_than_the_first_read_looks_at_is_still_the_parent(
        redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    """A harness that puts assistant messages of its own after a reply (worked examples, a replayed
    transcript): the call still extends the reply it follows, found past the latest replies the call's
    first read looks for (`NEAREST_REPLIES`)."""
    from openai import OpenAI

    from pipeline.serve.turns import NEAREST_REPLIES

    script = Script(tools_tokenizer, {0: "First.", 1: "Second."})
    stack = serve()
    sid = stack.session()

    def agent() -> None:
        client = OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Start."}]
        reply = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        for k in range(NEAREST_REPLIES + 1):
            messages += [{"role": "user", "content": f"Example {k}?"}, {"role": "assistant", "content": f"Ans {k}."}]
        messages.append({"role": "user", "content": "Now you."})
        client.chat.completions.create(model="m", messages=messages)
        client.close()

    run_agent(redis_client, script.engine(), agent)
    assert _calls(redis_client, stack.run, sid)[1]["parent_turn"] == 0
    assert [item["turns"] for item in exact_lineages(redis_client, stack.run, sid, script)] == [[0, 1]]


_STRIPPING_TEMPLATE = """\
{%- set last = namespace(user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '<|system|>' + m.content -}}
{%- elif m.role == 'user' -%}{{- '<|user|>' + m.content -}}
{%- elif m.role == 'assistant' -%}
{%- set content = m.content.split('</think>')[-1] -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > last.user and m.reasoning_content -%}
{{- '<think>' + m.reasoning_content + '</think>' -}}
{%- endif -%}
{{- content -}}
{%- endif -%}
{{- '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
"""


@pytest.fixture
def thinking_tokenizer(tmp_path: Path) -> Path:
    """The tiny tokenizer under a Qwen3-style template: an assistant message before the last user
    message is rendered without its reasoning; `<think>` and `</think>` are not special tokens (as in
    Qwen3's tokenizer), so a completion decoded without special tokens keeps them for the parser."""
    folder = tmp_path / "tiny-think"
    folder.mkdir()
    shutil.copy(TOKENIZER / "tokenizer_config.json", folder / "tokenizer_config.json")
    spec = json.loads((TOKENIZER / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = False
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "chat_template.jinja").write_text(_STRIPPING_TEMPLATE)
    return folder


@pytest.mark.parametrize("history", ["verbatim", "template"])
def test_a_reasoning_template_under_each_history_mode(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any,
                                                      thinking_tokenizer: Path, history: str) -> None:
    """verbatim: the second call extends the first as sampled, its reasoning kept (one lineage).
    template: each call is what the template renders, reasoning stripped; that is not an extension of
    what was sampled, so the second call is a root of its own (two lineages, each exact)."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    script = Script(tools_tokenizer, {0: "<think>Two and three.</think>It is 5.",
                                      1: "<think>One and one.</think>It is 2."})
    stack = serve(tokenizer=str(thinking_tokenizer), tool_call_parser=None, reasoning_parser="qwen3")
    sid = stack.session(history=history)
    second: list[dict[str, Any]] = []

    def agent() -> None:
        client = OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2 + 3?"}]
        first = client.chat.completions.create(model="m", messages=messages).choices[0].message
        assert first.content == "It is 5." and first.reasoning_content == "Two and three."
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "1 + 1?"}]
        second.extend(messages)
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "It is 2."
        client.close()

    run_agent(redis_client, script.engine(), agent)
    lineages = exact_lineages(redis_client, stack.run, sid, script)
    calls = _calls(redis_client, stack.run, sid)
    rendered = AutoTokenizer.from_pretrained(str(thinking_tokenizer)).apply_chat_template(
        second, add_generation_prompt=True, tokenize=False)
    if history == "verbatim":
        assert [item["turns"] for item in lineages] == [[0, 1]] and calls[1]["parent_turn"] == 0
        text = tools_tokenizer.decode(lineages[0]["input_ids"])
        assert "<|assistant|><think>Two and three.</think>It is 5.<|end|>\n<|user|>1 + 1?" in text
        assert tools_tokenizer.decode(calls[1]["prompt_token_ids"]) != rendered
    else:
        assert sorted(item["turns"] for item in lineages) == [[0], [1]] and calls[1]["parent_turn"] is None
        assert tools_tokenizer.decode(calls[1]["prompt_token_ids"]) == rendered
        assert "Two and three" not in rendered and calls[1]["prefix_break"]
