"""A streamed answer through an `sglang-http` worker is the non-streamed one, on a server that streams
as SGLang does (the stand-in, `tests.helpers.sglang_standin`: cumulative chunks, the matched EOS id
the last chunk's last token): the server holds a last token that the model may stop on by the rule
SGLang stops by (`pipeline.core.stop_tokens`), here an EOS only generation_config.json declares.
The stand-in holds its answer after that last chunk, before `[DONE]`, until the worker has published
the EOS to the turn's token stream: so the server sees it streamed before the answer, every time."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import turn_stream
from tests.helpers.models import IM_END_ID, build_chat_model
from tests.helpers.processes import wait_until
from tests.pipeline.serve.conftest import run_agent
from tests.pipeline.serve.test_agent_episodes import ADD_TOOL, _client
from tests.workers.engines.conftest import Standin, launch, stop, wait_ready
from workers.engines.sglang.http_engine import SGLangHTTPEngine

REPLY = "Hi, yes."


@pytest.fixture(scope="module")
def chat_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    model = build_chat_model(tmp_path_factory.mktemp("chat-model"), REPLY)
    server = launch(model, tmp_path_factory.mktemp("standin") / "chat.log")
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def test_a_streamed_answer_is_the_non_streamed_one(redis_client: redis.Redis, serve: Any,
                                                   chat_standin: Standin) -> None:
    stack = serve(tokenizer=str(chat_standin.model_dir))
    messages = [{"role": "user", "content": "hi"}]
    got: dict[str, Any] = {"content": "", "finish": []}

    def agent() -> None:  # tools given, as an agent's calls have: special tokens stay in the text
        stream = _client(stack.url, stack.session()).chat.completions.create(
            model="m", messages=messages, tools=[ADD_TOOL], stream=True)
        for chunk in stream:
            for choice in chunk.choices:
                got["content"] += choice.delta.content or ""
                if choice.finish_reason:
                    got["finish"].append(choice)
        got["plain"] = _client(stack.url, stack.session()).chat.completions.create(
            model="m", messages=messages, tools=[ADD_TOOL])

    def eos_published() -> bool:
        for stream in redis_client.scan_iter(match=keys.turn_stream("*")):
            turn_id = stream.decode().split(":")[-2]
            for _, fields in redis_client.xrange(stream):
                delta = turn_stream.parse(turn_id, fields)
                if delta is not None and IM_END_ID in delta.token_ids:
                    return True
        return False

    def release() -> None:
        try:
            wait_until(eos_published, 60, "the EOS published to the turn's token stream")
        finally:
            chat_standin.faults(release_streams=True)

    chat_standin.faults(hold_streams_after=len(REPLY) + 1)
    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    try:
        run_agent(redis_client, SGLangHTTPEngine([chat_standin.url]), agent)
    finally:
        chat_standin.faults(release_streams=True, hold_streams_after=None)
        releaser.join(60)
    plain = got["plain"].choices[0]
    assert plain.message.content == REPLY and plain.finish_reason == "stop"
    assert plain.model_extra["token_ids"][-1] == IM_END_ID  # the answer ended on the EOS only generation_config has
    assert got["content"] == plain.message.content
    (finish,) = got["finish"]
    assert finish.finish_reason == "stop" and finish.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert chat_standin.stats()["rids"], "the calls did not reach the stand-in"
