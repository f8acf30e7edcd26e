"""Streamed calls get their tokens as the engine generates them (the real `openai` SDK and the Agents
SDK's `run_streamed` against the real server and a worker): the first text arrives while the turn
is still held mid-way in the engine, and the streamed answer and the committed row are the
non-streamed call's. The scripted engine reveals its tokens one position at a time (`FakeEngine(pace=)`)
and holds at a position until the client has seen text, so nothing here depends on timing."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import openai
import pytest
import redis

from tests.pipeline.serve.conftest import Script, run_agent
from tests.pipeline.serve.test_agent_episodes import ADD_TOOL, CALL, _client, _turn_rows

HOLD = 4  # the engine holds every batch after this many tokens until the client has seen text
ROW_FIELDS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs", "weight_version",
              "weight_version_segments", "prompt_tokens")


class Hold:
    """`pace` for the fake engine: holds at position `HOLD` until `release` (a minute at most: a
    broken stream then shows as text that came only after the hold, not as a hung test)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, k: int) -> None:
        if k == HOLD:
            self.release.wait(60)


def _same_rows(conn: redis.Redis, run: str) -> None:
    """The streamed session's row and the plain session's are the same sample."""
    rows = _turn_rows(conn, run)
    assert len(rows) == 2, rows
    streamed, plain = ({f: r[f] for f in ROW_FIELDS} for r in rows)
    assert streamed == plain


def test_text_reaches_the_client_while_the_turn_is_generated(redis_client: redis.Redis, serve: Any,
                                                             tools_tokenizer: Any) -> None:
    answer = "The answer is five, as you said before."
    script = Script(tools_tokenizer, {0: answer})
    hold = Hold()
    stack = serve()
    streamed_sid, plain_sid = stack.session(), stack.session()
    messages = [{"role": "user", "content": "2+3?"}]
    got: dict[str, Any] = {"content": "", "chunks": []}

    def agent() -> None:
        stream = _client(stack.url, streamed_sid).chat.completions.create(
            model="m", messages=messages, stream=True, logprobs=True, stream_options={"include_usage": True})
        for chunk in stream:
            got["chunks"].append(chunk)
            for choice in chunk.choices:
                if choice.delta.content and "first" not in got:
                    got["first"] = choice.delta.content
                    got["held"] = not hold.release.is_set()
                    got["rows_then"] = len(_turn_rows(redis_client, stack.run))
                    hold.release.set()
                got["content"] += choice.delta.content or ""
        got["plain"] = _client(stack.url, plain_sid).chat.completions.create(model="m", messages=messages,
                                                                              logprobs=True)

    run_agent(redis_client, script.engine(pace=hold), agent)
    assert got["held"] and got["rows_then"] == 0, "no text reached the client before the turn finished"
    assert answer.startswith(got["first"])
    plain = got["plain"].choices[0]
    assert got["content"] == plain.message.content == answer
    (finish,) = [c.choices[0] for c in got["chunks"] if c.choices and c.choices[0].finish_reason]
    assert finish.finish_reason == plain.finish_reason == "stop"
    assert finish.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert [t.logprob for t in finish.logprobs.content] == [t.logprob for t in plain.logprobs.content]
    assert got["chunks"][-1].usage.completion_tokens == got["plain"].usage.completion_tokens
    _same_rows(redis_client, stack.run)


def test_content_stops_where_a_tool_call_begins(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    """Text before a call streams; the call's markup never does; the call comes whole at the end."""
    script = Script(tools_tokenizer, {0: f"Let me add these two.{CALL}"})
    hold = Hold()
    stack = serve()
    streamed_sid, plain_sid = stack.session(), stack.session()
    messages = [{"role": "user", "content": "2+3?"}]
    got: dict[str, Any] = {"deltas": [], "calls": []}

    def agent() -> None:
        stream = _client(stack.url, streamed_sid).chat.completions.create(
            model="m", messages=messages, tools=[ADD_TOOL], stream=True)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    got["deltas"].append((choice.delta.content, hold.release.is_set()))
                    hold.release.set()
                got["calls"] += choice.delta.tool_calls or []
                got["finish"] = choice.finish_reason or got.get("finish")
        got["plain"] = _client(stack.url, plain_sid).chat.completions.create(model="m", messages=messages,
                                                                              tools=[ADD_TOOL])

    run_agent(redis_client, script.engine(pace=hold), agent)
    plain = got["plain"].choices[0]
    assert got["deltas"][0][1] is False  # the first text came while the turn was held
    assert "".join(text for text, _ in got["deltas"]) == plain.message.content == "Let me add these two."
    assert not any("<" in text for text, _ in got["deltas"])
    assert [(c.function.name, c.function.arguments) for c in got["calls"]] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    assert got["finish"] == plain.finish_reason == "tool_calls"
    _same_rows(redis_client, stack.run)


def test_a_streamed_text_completion(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: "one two three four five six"})
    hold = Hold()
    stack = serve()
    streamed_sid, plain_sid = stack.session(), stack.session()
    got: dict[str, Any] = {"text": ""}

    def agent() -> None:
        for chunk in _client(stack.url, streamed_sid).completions.create(model="m", prompt="Count:", stream=True):
            if chunk.choices[0].text and "held" not in got:
                got["held"] = not hold.release.is_set()
                hold.release.set()
            got["text"] += chunk.choices[0].text
        got["plain"] = _client(stack.url, plain_sid).completions.create(model="m", prompt="Count:")

    run_agent(redis_client, script.engine(pace=hold), agent)
    assert got["held"] and got["text"] == got["plain"].choices[0].text == "one two three four five six"
    _same_rows(redis_client, stack.run)


@pytest.fixture(autouse=True)
def _no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def test_the_agents_sdk_run_streamed_gets_text_deltas_as_they_come(redis_client: redis.Redis, serve: Any,
                                                                   tools_tokenizer: Any) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    answer = "Two and three make five, as always."
    script = Script(tools_tokenizer, {0: answer})
    hold = Hold()
    stack = serve()
    sid = stack.session()
    got: dict[str, Any] = {"deltas": []}

    async def main() -> None:
        client = AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0)
        agent = Agent(name="calc", instructions="You add.", model=OpenAIChatCompletionsModel(
            model="tiny-tools", openai_client=client))
        try:
            streamed = Runner.run_streamed(agent, "What is 2 + 3?")
            async for event in streamed.stream_events():
                if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
                    got["deltas"].append((event.data.delta, hold.release.is_set()))
                    hold.release.set()
            got["final"] = streamed.final_output
        finally:
            await client.close()

    run_agent(redis_client, script.engine(pace=hold), lambda: asyncio.run(main()))
    assert got["deltas"] and got["deltas"][0][1] is False  # text arrived while the turn was held
    assert "".join(d for d, _ in got["deltas"]) == got["final"] == answer


def test_a_partial_weight_swap_mid_stream_keeps_each_tokens_version(redis_client: redis.Redis, serve: Any,
                                                                    tools_tokenizer: Any) -> None:
    """The sim decodes a long answer; once the client has text, a partial push swaps the weights under
    it: the stream goes on without a break, and the recorded row holds both versions, each token's."""
    import pipeline
    from workers.engines.sim.engine import SimConfig, SimEngine

    engine = SimEngine(SimConfig(capacity=4, step_s=0.01, median_tokens=150, p99_tokens=151,
                                 vocab_size=len(tools_tokenizer), eos_token_id=tools_tokenizer.eos_token_id))
    stack = serve(tool_call_parser=None)
    sid = stack.session()
    call = {"model": "m", "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 150,
            "extra_body": {"ignore_eos": True}}
    got: dict[str, Any] = {"content": ""}

    def agent() -> None:
        for chunk in _client(stack.url, sid).chat.completions.create(stream=True, **call):
            for choice in chunk.choices:
                got["content"] += choice.delta.content or ""
                if choice.delta.content and "pushed" not in got:
                    got["pushed"] = pipeline.Client(redis_client).push_weights("/ckpt/v1", version=1, timeout=30,
                                                                              mode="partial")
                if choice.finish_reason:
                    got["token_ids"] = choice.model_extra["token_ids"]
        # The SDK's retry of the same call (x-stainless-retry-count > 0): its recorded answer.
        got["recorded"] = _client(stack.url, sid).chat.completions.create(
            **call, extra_headers={"x-stainless-retry-count": "1"})

    run_agent(redis_client, engine, agent)
    (row,) = _turn_rows(redis_client, stack.run)
    assert [s["version"] for s in row["weight_version_segments"]] == [0, 1]  # swapped mid-answer
    assert got["token_ids"] == row["completion_token_ids"] and len(row["completion_token_ids"]) == 150
    assert got["content"] == got["recorded"].choices[0].message.content  # every token once, in order


def test_a_stream_through_sentinel_comes_as_it_is_generated(tmp_path: Any, tools_tokenizer: Any) -> None:
    """Behind Sentinel the server has no asyncio Redis client: each read of the token stream blocks a
    thread instead, and the text still arrives while the turn is held mid-way."""
    from pipeline.core.broker.connection import connect_redis
    from pipeline.serve.server import ServeConfig, Server
    from tests.helpers.processes import drive_worker
    from tests.helpers.sentinel_group import SentinelGroup
    from tests.pipeline.serve.conftest import TOKENIZER

    answer = "Through the sentinel, one token at a time."
    script = Script(tools_tokenizer, {0: answer})
    hold = Hold()
    got: dict[str, Any] = {"content": ""}
    with SentinelGroup(tmp_path / "sentinel", replicas=0, sentinels=1) as group:
        conn = connect_redis(group.url)
        server = Server(ServeConfig(port=0, redis_url=group.url, tokenizer=str(TOKENIZER), run="agents",
                                    output=f"file://{tmp_path}/shards", turn_timeout_s=30)).start()
        try:
            def agent() -> None:
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
                for chunk in client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "2+3?"}], stream=True,
                        extra_headers={"X-Session-Id": "s1"}):
                    for choice in chunk.choices:
                        if choice.delta.content and "held" not in got:
                            got["held"] = not hold.release.is_set()
                            hold.release.set()
                        got["content"] += choice.delta.content or ""

            drive_worker(conn, script.engine(pace=hold), agent, stop_when_done=True)
        finally:
            server.stop()
    assert got["held"] and got["content"] == answer
