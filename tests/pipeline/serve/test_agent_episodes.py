"""Agent episodes through `pipeline serve` with the real `openai` SDK: tool calls over several turns,
the prefix rule checked token by token, prefix breaks, retries, streaming, n > 1, a server
restarted mid-episode, and the trajectories a trainer reads back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow.compute as pc
import pytest
import redis

import pipeline
from pipeline.core.broker import commit_log, keys
from pipeline.core.shards import read_rollouts
from pipeline.read.lineage_rows import turn_rows
from tests.helpers.processes import wait_until
from tests.pipeline.serve.conftest import Script, run_agent

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def _client(url: str, session_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/sessions/{session_id}/v1", api_key="unused", max_retries=0)


def _turn_rows(conn: redis.Redis, run: str) -> list[dict[str, Any]]:
    rows = turn_rows(run, conn).to_pylist()
    return sorted(rows, key=lambda r: (r["session_id"], r["turn"], r["sample_index"]))


def _episode(client: openai.OpenAI) -> tuple[Any, Any, list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You add."},
                                      {"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    result = json.loads(call.function.arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result["a"] + result["b"])})
    second = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], temperature=0)
    return first, second, messages


def test_a_tool_calling_episode_is_one_exact_trajectory(redis_client: redis.Redis, serve: Any,
                                                        tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: f"Let me add.{CALL}", 1: "2 + 3 = 5."})
    stack = serve()
    sid = stack.session(metadata={"task": "add"})
    seen: dict[str, Any] = {}

    def agent() -> None:
        client = _client(stack.url, sid)
        seen["first"], seen["second"], _ = _episode(client)
        reward = client.post(f"{stack.url}/sessions/{sid}/reward", body={"reward": 1.0}, cast_to=object)
        assert reward["reward"] == {"reward": 1.0}

    run_agent(redis_client, script.engine(), agent)
    first, second = seen["first"], seen["second"]
    # The answer is parsed as SGLang parses it: content kept beside the tool call.
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.content == "Let me add."
    assert first.choices[0].message.tool_calls[0].function.name == "add"
    assert json.loads(first.choices[0].message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "2 + 3 = 5."

    rows = _turn_rows(redis_client, stack.run)
    assert [(r["turn"], r["prefix_break"]) for r in rows] == [(0, False), (1, False)]
    # The prefix rule: turn 1's prompt is turn 0's prompt + its sampled ids verbatim + the new messages.
    head = rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"]
    assert rows[1]["prompt_token_ids"][: len(head)] == head
    glue = tools_tokenizer.decode(rows[1]["prompt_token_ids"][len(head):], skip_special_tokens=False)
    assert glue == "\n<|tool|>5<|end|>\n<|assistant|>"
    assert rows[0]["completion_token_ids"][-1] == tools_tokenizer.eos_token_id

    (item,) = pipeline.read_trajectories(stack.run, conn=redis_client).to_pylist()
    ids, mask = item["input_ids"], item["loss_mask"]
    assert ids == rows[1]["prompt_token_ids"] + rows[1]["completion_token_ids"]
    sampled = {p for r in rows for p in range(len(r["prompt_token_ids"]),
                                              len(r["prompt_token_ids"]) + len(r["completion_token_ids"]))}
    for position in range(len(ids)):  # token by token: 1 exactly where the model sampled
        assert mask[position] == (1 if position in sampled else 0), position
        assert item["old_logprobs"][position] == (-0.5 if position in sampled else 0.0)
        assert item["token_weight_version"][position] == (0 if position in sampled else -1)
    assert item["turn_starts"] == [len(r["prompt_token_ids"]) for r in rows]
    assert item["reward"] == 1.0 and item["lineages"] == 1
    # The server writes the run's turn count every half second (`pipeline.serve.turn_counts`).
    wait_until(lambda: redis_client.hgetall(keys.run_turn_stats(stack.run)) == {b"turns": b"2"}, timeout=10,
               what="the run's turn count")


def test_a_rewritten_history_is_a_counted_prefix_break(redis_client: redis.Redis, serve: Any,
                                                       tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: "Hello.", 1: "Again.", 2: "Third."})
    stack = serve()
    sid = stack.session()

    def agent() -> None:
        client = _client(stack.url, sid)
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        client.chat.completions.create(model="m", messages=messages)
        # The agent summarises its history: not an extension of what was served.
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "summary: hi, more"},
                                                            {"role": "user", "content": "go on"}])

    run_agent(redis_client, script.engine(), agent)
    rows = _turn_rows(redis_client, stack.run)
    assert [r["prefix_break"] for r in rows] == [False, False, True]
    assert redis_client.hget(keys.run_turn_stats(stack.run), "prefix_breaks") == b"1"
    items = pipeline.read_trajectories(stack.run, conn=redis_client).to_pylist()
    assert [(i["lineage"], i["lineages"], i["turns"]) for i in items] == [(0, 2, [0, 1]), (1, 2, [2])]
    assert items[1]["input_ids"] == rows[2]["prompt_token_ids"] + rows[2]["completion_token_ids"]
    # The same episodes as torch batches: padded, the masks and logprobs where the items have them.
    from pipeline.read.torch_data import RolloutBatches

    (batch,) = list(RolloutBatches(stack.run, conn=redis_client, trajectories=True, batch_size=8, pad_id=0))
    assert batch["session_id"] == [sid, sid] and batch["lineage"] == [0, 1]
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == item["input_ids"]
        assert batch["attention_mask"][row].sum().item() == n
        assert batch["loss_mask"][row, :n].tolist() == item["loss_mask"]
        assert batch["old_logprobs"][row, :n].tolist() == item["old_logprobs"]
    assert batch["reward"].isnan().all()  # no reward recorded for this session


def test_a_retried_call_is_answered_again_not_generated_again(redis_client: redis.Redis, serve: Any,
                                                              tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: "Once."})
    stack = serve()
    sid = stack.session()
    answers: list[Any] = []
    messages = [{"role": "user", "content": "x"}]

    def agent() -> None:
        client = _client(stack.url, sid)
        answers.append(client.chat.completions.create(model="m", messages=messages))
        # The SDK's own retry after a lost answer (it says so in x-stainless-retry-count) ...
        answers.append(client.chat.completions.create(model="m", messages=messages,
                                                      extra_headers={"x-stainless-retry-count": "1"}))
        # ... and a client that says nothing (a bare HTTP retry), and one retrying under its idempotency key.
        bare = httpx.post(f"{stack.url}/sessions/{sid}/v1/chat/completions", json={"model": "m", "messages": messages},
                          timeout=30)
        answers.append(openai.types.chat.ChatCompletion.model_validate(bare.json()))
        keyed = [client.chat.completions.create(model="m", messages=messages, extra_headers={"Idempotency-Key": "k1"})
                 for _ in range(2)]
        answers.extend(keyed)

    run_agent(redis_client, script.engine(), agent)
    assert len({a.id for a in answers[:3]}) == 1 and answers[0].choices[0].message.content == "Once."
    assert answers[3].id == answers[4].id != answers[0].id  # the key names a call of its own, answered once
    assert len(script.seen) == 2 and len(_turn_rows(redis_client, stack.run)) == 2


def test_the_same_call_made_twice_on_purpose_is_two_calls(redis_client: redis.Redis, serve: Any,
                                                          tools_tokenizer: Any) -> None:
    """A harness sending one sub-agent call twice (the openai SDK says each is a first try): two calls,
    both generated and recorded, each a root of the session's tree."""
    script = Script(tools_tokenizer, {0: "One.", 1: "Two."})
    stack = serve()
    sid = stack.session()
    answers: list[Any] = []

    def agent() -> None:
        client = _client(stack.url, sid)
        answers.extend(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
                       for _ in range(2))

    run_agent(redis_client, script.engine(), agent)
    assert [a.choices[0].message.content for a in answers] == ["One.", "Two."]
    rows = _turn_rows(redis_client, stack.run)
    assert [(r["turn"], r["parent_turn"]) for r in rows] == [(0, None), (1, None)]


def test_ending_a_session_with_a_call_in_flight_answers_and_keeps_the_call(redis_client: redis.Redis, serve: Any,
                                                                           tools_tokenizer: Any) -> None:
    """A harness ends its episode while a sub-agent's call is still generating: that call is answered
    and its row kept (it was admitted before the end); a call after the end is refused."""
    import threading

    from tests.helpers.session_calls import turn_ids_in_flight

    script = Script(tools_tokenizer, {0: "Late but kept."})
    stack = serve()
    sid = stack.session()
    answers: list[Any] = []
    call = threading.Thread(target=lambda: answers.append(_client(stack.url, sid).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}])))
    call.start()  # no worker yet: the call waits in the queue
    wait_until(lambda: len(turn_ids_in_flight(redis_client, sid)) == 1, timeout=30, what="the call in flight")
    ended = httpx.post(f"{stack.url}/sessions/{sid}/end", timeout=30)
    assert ended.status_code == 200, ended.text

    run_agent(redis_client, script.engine(), lambda: call.join(timeout=60))
    assert [a.choices[0].message.content for a in answers] == ["Late but kept."]
    assert [r["turn"] for r in _turn_rows(redis_client, stack.run)] == [0]
    shown = httpx.get(f"{stack.url}/sessions/{sid}", timeout=30).json()
    assert (shown["state"], shown["turns"], shown["calls_in_flight"]) == ("ended", 1, 0)
    with pytest.raises(openai.ConflictError, match="has ended"):
        _client(stack.url, sid).chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])


def test_streaming_n_and_logprobs(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: f"Adding.{CALL}"})
    stack = serve()
    sid = stack.session()
    got: dict[str, Any] = {}

    def agent() -> None:
        client = _client(stack.url, sid)
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2+3?"}], tools=[ADD_TOOL], n=2, logprobs=True,
            stream=True, stream_options={"include_usage": True})
        got["chunks"] = list(stream)

    run_agent(redis_client, script.engine(), agent)
    chunks = got["chunks"]
    by_choice: dict[int, dict[str, Any]] = {0: {"content": "", "calls": [], "finish": None},
                                            1: {"content": "", "calls": [], "finish": None}}
    for chunk in chunks:
        for choice in chunk.choices:
            state = by_choice[choice.index]
            state["content"] += choice.delta.content or ""
            state["calls"] += choice.delta.tool_calls or []
            state["finish"] = choice.finish_reason or state["finish"]
            if choice.logprobs is not None and choice.logprobs.content:
                state["logprobs"] = [t.logprob for t in choice.logprobs.content]
    for state in by_choice.values():
        assert state["content"] == "Adding." and state["finish"] == "tool_calls"
        assert [c.function.name for c in state["calls"]] == ["add"]
        assert state["logprobs"] and set(state["logprobs"]) == {-0.5}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert len(_turn_rows(redis_client, stack.run)) == 2  # one row per sample


def test_the_async_client_runs_sessions_concurrently(redis_client: redis.Redis, serve: Any,
                                                     tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, default="fine")
    stack = serve()
    sessions = [stack.session() for _ in range(4)]
    answers: list[str] = []

    async def episode(sid: str) -> None:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
        for _ in range(3):
            answer = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": "b"}]
            answers.append(answer.choices[0].message.content)
        await client.close()

    async def all_episodes() -> None:
        await asyncio.gather(*(episode(s) for s in sessions))

    run_agent(redis_client, script.engine(), lambda: asyncio.run(all_episodes()))
    assert answers == ["fine"] * 12
    items = pipeline.read_trajectories(stack.run, conn=redis_client).to_pylist()
    assert sorted(i["session_id"] for i in items) == sorted(sessions)
    assert all(i["lineages"] == 1 and i["turns"] == [0, 1, 2] for i in items)


def test_a_server_restarted_mid_episode_loses_nothing(redis_client: redis.Redis, serve: Any,
                                                      tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, {0: f"Adding.{CALL}", 1: "5."})
    first_server = serve()
    sid = first_server.session()

    def agent() -> None:
        client = _client(first_server.url, sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2+3?"}]
        answer = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        first_server.server.stop()  # the server dies between turns; another one takes over
        second = serve()
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": answer.choices[0].message.tool_calls[0].id, "content": "5"}]
        final = _client(second.url, sid).chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        assert final.choices[0].message.content == "5."

    run_agent(redis_client, script.engine(), agent)
    rows = _turn_rows(redis_client, first_server.run)
    assert [r["prefix_break"] for r in rows] == [False, False]


def test_turn_rows_land_in_shards_many_turns_each(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    script = Script(tools_tokenizer, default="ok")
    stack = serve()

    def agent() -> None:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        for i in range(6):  # calls without a session: sessions of one turn each
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])

    run_agent(redis_client, script.engine(), agent)
    table = read_rollouts([], run=stack.run, conn=redis_client)  # the worker flushed the log as it stopped
    assert table.num_rows == 6 and pc.count_distinct(table.column("job_id")).as_py() == 6  # each turn its job
    shards = sorted(Path(stack.output.removeprefix("file://"), stack.run).glob("*.parquet"))
    assert [s.name.startswith("turns-") for s in shards] == [True]  # six turns, one shard
    assert [c.rows for c in commit_log.read_all(redis_client, stack.run)] == [6]
    assert redis_client.xlen(keys.turn_log(stack.run)) == 0
    assert sorted(pc.unique(table.column("turn")).to_pylist()) == [0]
