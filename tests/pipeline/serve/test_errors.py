"""`pipeline serve` refuses bad calls in OpenAI's error format, never hangs, and stays up for others."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import openai
import pytest
import redis

from pipeline.core.broker import control_channel, keys
from pipeline.core.errors import PipelineError
from pipeline.serve.app import json_depth
from pipeline.serve.server import ServeConfig, check_config
from tests.pipeline.serve.conftest import Script, run_agent

USER = [{"role": "user", "content": "hi"}]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_malformed_bodies_are_400s_naming_what_is_wrong(serve: Any) -> None:
    url = serve().url + "/v1/chat/completions"
    assert "not valid JSON" in _error(httpx.post(url, content=b"{nope"), 400)["message"]
    assert "not UTF-8" in _error(httpx.post(url, content=b'{"messages": "\xff"}'), 400)["message"]
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert "nests deeper" in _error(httpx.post(url, content=deep), 400)["message"]
    error = _error(httpx.post(url, json={"messages": USER, "temprature": 0.5}), 400)
    assert error["param"] == "temprature" and "unknown field" in error["message"]
    error = _error(httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "n": 0}), 400)
    assert error["param"] == "n"
    error = _error(httpx.post(url, json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    assert error["param"].startswith("messages.0")


def test_json_that_only_the_standard_library_parses_is_judged_by_its_fields(serve: Any) -> None:
    """The body is parsed by orjson, which refuses NaN and integers past 64 bits; Python's parser takes
    both, so such a body is refused where its value is wrong, as before, not as invalid JSON."""
    url = serve().url + "/v1/chat/completions"
    for value in (b"1" + b"0" * 25, b"NaN"):
        body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + value + b"}"
        error = _error(httpx.post(url, content=body, headers={"content-type": "application/json"}), 400)
        assert error["param"] == "temperature" and error["code"] != "invalid_json", error


def test_huge_bodies_are_refused_and_the_server_serves_on(redis_client: redis.Redis, serve: Any,
                                                          tools_tokenizer: Any) -> None:
    stack = serve(max_body_bytes=64 * 1024)
    huge = {"messages": [{"role": "user", "content": "x" * 200_000}]}
    assert _error(httpx.post(stack.url + "/v1/chat/completions", json=huge), 413)["code"] == "body_too_large"
    answers: list[str] = []

    def agent() -> None:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        answers.append(client.chat.completions.create(model="m", messages=USER).choices[0].message.content)

    run_agent(redis_client, Script(tools_tokenizer, default="still here").engine(), agent)
    assert answers == ["still here"]


def test_a_prompt_over_the_context_is_a_400_and_leaves_no_session_open(redis_client: redis.Redis,
                                                                        serve: Any) -> None:
    url = serve(context_length=32).url + "/v1/chat/completions"
    error = _error(httpx.post(url, json={"messages": [{"role": "user", "content": "word " * 50}]}), 400)
    assert error["code"] == "context_length_exceeded" and "maximum context length is 32" in error["message"]
    error = _error(httpx.post(url, json={"messages": USER, "max_tokens": 1000}), 400)
    assert "max_tokens asks for 1000" in error["message"]
    # The calls named no session: each had one of its own, ended with the refusal (none left open).
    assert redis_client.scard(keys.pool(None).open_sessions) == 0


def test_unknown_and_ended_sessions(serve: Any) -> None:
    stack = serve()
    error = _error(httpx.post(stack.url + "/sessions/nope/v1/chat/completions", json={"messages": USER}), 404)
    assert error["code"] == "session_not_found"
    sid = stack.session()
    assert httpx.post(f"{stack.url}/sessions/{sid}/end").json()["state"] == "ended"
    error = _error(httpx.post(f"{stack.url}/sessions/{sid}/v1/chat/completions", json={"messages": USER}), 409)
    assert error["code"] == "session_ended"
    error = _error(httpx.post(f"{stack.url}/sessions/{sid}/reward", json={"reward": "high"}), 400)
    assert error["param"] == "rewards.reward"
    assert _error(httpx.post(f"{stack.url}/sessions", json={"session_id": sid}), 409)


def test_no_live_worker_is_a_503_with_retry_after_and_the_turn_stays_queued(redis_client: redis.Redis, serve: Any,
                                                                            tools_tokenizer: Any) -> None:
    stack = serve(turn_timeout_s=0.5)
    sid = stack.session()
    url = f"{stack.url}/sessions/{sid}/v1/chat/completions"
    response = httpx.post(url, json={"messages": USER}, timeout=30)
    assert _error(response, 503)["code"] == "no_worker" and int(response.headers["retry-after"]) >= 1
    stack2 = serve(turn_timeout_s=30)
    got: list[Any] = []

    def agent() -> None:  # the agent's retry finds the queued turn answered: generated once
        got.append(httpx.post(f"{stack2.url}/sessions/{sid}/v1/chat/completions", json={"messages": USER},
                              timeout=60).json())

    script = Script(tools_tokenizer, default="late")
    run_agent(redis_client, script.engine(), agent)
    assert got[0]["choices"][0]["message"]["content"] == "late" and len(script.seen) == 1


def test_a_paused_pool_is_a_503(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    stack = serve(turn_timeout_s=1.0)
    control_channel.pause(redis_client)
    responses: list[httpx.Response] = []

    def agent() -> None:
        responses.append(httpx.post(stack.url + "/v1/chat/completions", json={"messages": USER}, timeout=30))

    try:
        run_agent(redis_client, Script(tools_tokenizer).engine(), agent)
    finally:
        control_channel.resume(redis_client)
    assert "paused" in _error(responses[0], 503)["message"]


def test_a_turn_that_does_not_finish_in_time_is_a_504(redis_client: redis.Redis, serve: Any,
                                                      tools_tokenizer: Any) -> None:
    stack = serve(turn_timeout_s=1.0)
    responses: list[httpx.Response] = []

    def agent() -> None:
        responses.append(httpx.post(stack.url + "/v1/chat/completions", json={"messages": USER}, timeout=30))

    run_agent(redis_client, Script(tools_tokenizer).engine(delay_s=3.0), agent)
    assert _error(responses[0], 504)["code"] == "turn_timeout"


def test_a_failed_turn_says_why(redis_client: redis.Redis, serve: Any, tools_tokenizer: Any) -> None:
    stack = serve()
    sid = stack.session()
    responses: list[httpx.Response] = []

    def agent() -> None:
        responses.append(httpx.post(f"{stack.url}/sessions/{sid}/v1/chat/completions", json={"messages": USER},
                                    timeout=60))

    run_agent(redis_client, Script(tools_tokenizer).engine(fail_ids=[f"{sid}:0"]), agent)
    error = _error(responses[0], 500)
    assert error["code"] == "turn_failed" and "fail_ids" in error["message"]
    assert redis_client.smembers(keys.pool(None).open_sessions) == {sid.encode()}  # the named session stays open


def test_api_key_and_binding(serve: Any) -> None:
    stack = serve(api_key="sekret")
    assert _error(httpx.post(stack.url + "/v1/chat/completions", json={"messages": USER}), 401)
    assert httpx.get(stack.url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert httpx.get(stack.url + "/health").status_code == 200  # health needs no key
    with pytest.raises(PipelineError, match="--api-key"):
        check_config(ServeConfig(host="0.0.0.0"))
    check_config(ServeConfig(host="0.0.0.0", api_key="k"))
    with pytest.raises(PipelineError, match="tool-call-parser"):
        check_config(ServeConfig(tool_call_parser="nope"))


def test_an_unknown_path_or_method_answers_in_openais_error_shape(serve: Any) -> None:
    url = serve().url
    missing = _error(httpx.post(url + "/v1/chat/completion", json={}), 404)  # a typo'd path
    assert missing["code"] == "not_found" and "no route POST /v1/chat/completion" in missing["message"]
    assert _error(httpx.get(url + "/v1/chat/completions"), 405)["code"] == "405"


def test_json_depth_counts_brackets_outside_strings() -> None:
    assert [json_depth(text) for text in (b"1", b"[1]", b'{"a": {"b": []}}', b'{"a": "[[{{\\"]]"}')] == [1, 2, 4, 2]
    assert json_depth(b'{"m": ' + b"[" * 70 + b"]" * 70 + b"}") == 72


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=1)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=1)
    return 1


def test_json_depth_is_the_parsed_values_depth_whatever_the_strings_hold() -> None:
    """Strings of brackets, quotes and backslashes in every escaped form, in keys and values, both
    ASCII-escaped and not: the depth counted on the bytes is the depth of the parsed value."""
    rng = random.Random(0)
    pieces = ["\\", '"', "[", "]", "{", "}", "a", " ", "\\\\", '\\"', "é", "\n"]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))

    def value(level: int) -> Any:
        roll = rng.random()
        if level > 6 or roll < 0.3:
            return text() if rng.random() < 0.7 else rng.randint(0, 9)
        if roll < 0.65:
            return [value(level + 1) for _ in range(rng.randint(0, 3))]
        return {text(): value(level + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(3000):
        parsed = value(0)
        raw = json.dumps(parsed, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(raw) == _depth(parsed), raw
