"""`pipeline.serve.live`: what a streamed answer sends before its rows, and when it gives up."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.serve.answers import ParseRules
from pipeline.serve.api_error import APIError
from pipeline.serve.live import LiveTurn, TextRules

EOS = 0


def _decode(ids: Any) -> str:
    """A character per token: id k is chr(k); EOS decodes to a marker the answer never holds."""
    return "".join("<eos>" if i == EOS else chr(i) for i in ids)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _events(raw: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[len(b"data: "):]) for e in raw if e != b"data: [DONE]\n\n"]


def _sent(raw: list[bytes], field: str = "content") -> str:
    return "".join(c["delta"].get(field) or "" for e in _events(raw) for c in e.get("choices", []))


def _live(*, stops: tuple[str, ...] = (), rules: ParseRules | None = None, chat: bool = True, n: int = 1) -> LiveTurn:
    return LiveTurn(chat=chat, n=n, text=TextRules(_decode, frozenset({EOS}), stops), rules=rules,
                    head={"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 0, "model": "m"})


def _delta(text: str, offset: int = 0, attempt: int = 1, sample: int = 0) -> TokenDelta:
    return TokenDelta("t", attempt, sample, offset, _ids(text))


def test_a_stop_string_and_what_could_become_one_are_held() -> None:
    live = _live(stops=("\n\nUser:",))
    assert _sent(live.take([_delta("Hello\n")])) == "Hello"
    assert _sent(live.take([_delta("\nUs", offset=6)])) == ""  # "\n\nUs" may be the stop
    assert _sent(live.take([_delta("er: more", offset=9)])) == ""  # it was: nothing from it on


def test_the_last_token_is_held_while_it_may_be_the_stop_token() -> None:
    live = _live()
    assert _sent(live.take([_delta("Hi")])) == "Hi"
    assert _sent(live.take([TokenDelta("t", 1, 0, 2, [EOS])])) == ""  # never "<eos>"


def test_content_stops_at_a_call_marker_and_holds_a_partial_one() -> None:
    rules = ParseRules(None, "hermes", [{"type": "function", "function": {"name": "add"}}], False, None)
    live = _live(rules=rules)
    assert _sent(live.take([_delta("Let me add. <tool")])) == "Let me add."  # trailing space and "<tool" held
    assert _sent(live.take([_delta('_call>{"name"', offset=17)])) == ""
    assert live.choices[0].content_closed


def test_reasoning_streams_as_reasoning_content() -> None:
    rules = ParseRules("qwen3", None, None, False, None)
    live = _live(rules=rules)
    first = live.take([_delta("<think>Two plus three</th")])
    assert _sent(first, "reasoning_content") == "Two plus three" and _sent(first) == ""
    rest = live.take([_delta("ink>Five.", offset=25)])
    assert _sent(rest) == "Five." and _sent(rest, "reasoning_content") == ""


def test_a_new_attempt_that_repeats_what_was_sent_goes_on() -> None:
    live = _live()
    live.take([_delta("Hello wor")])
    assert _sent(live.take([_delta("Hello world", attempt=2)])) == "ld"


def test_a_new_attempt_from_an_older_checkpoint_goes_on_once_it_catches_up() -> None:
    live = _live()
    live.take([_delta("Hello wor")])
    assert _sent(live.take([_delta("Hello", attempt=2)])) == ""  # behind what was sent: nothing yet
    assert _sent(live.take([_delta(" world", offset=5, attempt=2)])) == "ld"


def test_a_new_attempt_that_differs_from_what_was_sent_ends_the_stream() -> None:
    live = _live()
    live.take([_delta("Hello")])
    with pytest.raises(APIError) as raised:
        live.take([_delta("Goodbye", attempt=2)])
    assert raised.value.code == "stream_diverged"


def test_a_late_reader_follows_the_newest_attempt_of_a_backlog() -> None:
    live = _live()
    sent = live.take([_delta("Hello"), _delta("Goodbye", attempt=2), _delta(" all", offset=7, attempt=2)])
    assert _sent(sent) == "Goodbye all"


def test_an_answer_that_does_not_begin_with_what_was_sent_is_an_error() -> None:
    live = _live()
    live.take([_delta("Hello")])
    answer = {"id": "chatcmpl-t", "created": 0, "usage": {}, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Bye"}, "finish_reason": "stop", "logprobs": None,
         "matched_stop": EOS, "rollout_id": "r", "weight_version": 0, "token_ids": _ids("Bye")}]}
    with pytest.raises(APIError):
        live.finish(answer)


def test_the_answer_sends_the_rest_then_the_finish() -> None:
    live = _live()
    live.take([_delta("Hello wo")])
    answer = {"id": "chatcmpl-t", "created": 0, "usage": {"completion_tokens": 12}, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hello world."}, "finish_reason": "stop",
         "logprobs": None, "matched_stop": EOS, "rollout_id": "r", "weight_version": 3,
         "token_ids": [*_ids("Hello world."), EOS]}]}
    raw = live.finish(answer)
    assert _sent(raw) == "rld." and raw[-1] == b"data: [DONE]\n\n"
    (finish,) = [c for e in _events(raw) for c in e["choices"] if c["finish_reason"]]
    assert finish["weight_version"] == 3 and finish["token_ids"][-1] == EOS


def test_a_sample_index_out_of_range_is_refused() -> None:
    with pytest.raises(APIError):
        _live(n=1).take([_delta("x", sample=3)])
