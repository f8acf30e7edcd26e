"""A conversation's digests, and a call's validated body, are the same whether a server saw the
session's earlier call or not: the cache that makes a call validate, dump and digest only its new
messages never changes where a call is placed or what it says."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pipeline.serve.answers import canonical_assistant
from pipeline.serve.conversation import Conversation, Conversations
from pipeline.serve.protocol import ChatCompletionBody
from schemas.chat import ChatMessage


def _messages(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    return messages


def _models(messages: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in messages]


def _same(a: Conversation, b: Conversation) -> None:
    assert len(a.messages) == len(b.messages)
    assert [a.first(n) for n in range(len(a.messages) + 1)] == [b.first(n) for n in range(len(b.messages) + 1)]
    assert a.earlier_replies(canonical_assistant) == b.earlier_replies(canonical_assistant)


def test_a_call_extending_the_last_one_gets_the_digests_of_a_fresh_reading() -> None:
    seen = Conversations()
    for turns in range(6):  # each call the last one's messages plus a reply and a new message
        _same(seen.of("s-1", _models(_messages(turns))), Conversation(_messages(turns)))


def test_a_call_that_does_not_extend_the_last_one_is_read_whole() -> None:
    """A branch (a sub-agent's call, a compacted history) or an edited earlier message."""
    seen = Conversations()
    seen.of("s-1", _models(_messages(4)))
    edited = _messages(5)
    edited[3] = {"role": "user", "content": "changed"}
    _same(seen.of("s-1", _models(edited)), Conversation(edited))
    _same(seen.of("s-1", _models(_messages(2))), Conversation(_messages(2)))  # shorter than the last one
    _same(seen.of("s-2", _models(_messages(3))), Conversation(_messages(3)))  # another session's


def test_the_least_recently_used_sessions_are_dropped() -> None:
    seen = Conversations(size=2)
    for session in ("a", "b", "a", "c"):
        seen.of(session, _models(_messages(1)))
    assert list(seen._latest) == ["a", "c"]


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "messages": [dict(m) for m in messages]}  # as parsed: new dicts


def test_a_call_validates_only_the_messages_its_sessions_last_call_did_not_have() -> None:
    seen = Conversations()
    first = seen.validated("s-1", _body(_messages(2)))
    second = seen.validated("s-1", _body(_messages(3)))
    assert second == ChatCompletionBody.model_validate(_body(_messages(3)))  # what a fresh validation gives
    shared = len(_messages(2))
    assert all(a is b for a, b in zip(first.messages, second.messages[:shared], strict=True))
    # Dumped once too: the conversation's dumps of the shared messages are the last call's.
    earlier = seen.of("s-1", first.messages)
    later = seen.of("s-1", second.messages)
    assert all(a is b for a, b in zip(earlier.messages, later.messages[:shared], strict=True))
    _same(later, Conversation(_messages(3)))


def test_an_edited_or_new_message_is_validated_where_it_stands() -> None:
    seen = Conversations()
    seen.validated("s-1", _body(_messages(2)))
    edited = _messages(3)
    edited[3] = {"role": "user", "content": None}  # was valid in the last call; a user message needs content
    with pytest.raises(ValidationError) as error:
        seen.validated("s-1", _body(edited))
    assert error.value.errors()[0]["loc"][:2] == ("messages", 3)
    new = [*_messages(3), {"role": "robot", "content": "x"}]
    with pytest.raises(ValidationError) as error:
        seen.validated("s-1", _body(new))
    assert error.value.errors()[0]["loc"][:2] == ("messages", len(new) - 1)
    other = seen.validated("s-2", _body(_messages(3)))  # another session's call shares no models
    assert other == ChatCompletionBody.model_validate(_body(_messages(3)))
