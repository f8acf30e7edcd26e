"""A conversation's digests are the same whether a server saw the session's earlier call or not:
the cache that makes a call digest only its new messages never changes where a call is placed."""

from __future__ import annotations

from typing import Any

from pipeline.serve.answers import canonical_assistant
from pipeline.serve.conversation import Conversation, Conversations


def _messages(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    return messages


def _same(a: Conversation, b: Conversation) -> None:
    assert len(a.messages) == len(b.messages)
    assert [a.first(n) for n in range(len(a.messages) + 1)] == [b.first(n) for n in range(len(b.messages) + 1)]
    assert a.earlier_replies(canonical_assistant) == b.earlier_replies(canonical_assistant)


def test_a_call_extending_the_last_one_gets_the_digests_of_a_fresh_reading() -> None:
    seen = Conversations()
    for turns in range(6):  # each call the last one's messages plus a reply and a new message
        _same(seen.of("s-1", _messages(turns)), Conversation(_messages(turns)))


def test_a_call_that_does_not_extend_the_last_one_is_read_whole() -> None:
    """A branch (a sub-agent's call, a compacted history) or an edited earlier message."""
    seen = Conversations()
    seen.of("s-1", _messages(4))
    edited = _messages(5)
    edited[3] = {"role": "user", "content": "changed"}
    _same(seen.of("s-1", edited), Conversation(edited))
    _same(seen.of("s-1", _messages(2)), Conversation(_messages(2)))  # shorter than the last one
    _same(seen.of("s-2", _messages(3)), Conversation(_messages(3)))  # another session's


def test_the_least_recently_used_sessions_are_dropped() -> None:
    seen = Conversations(size=2)
    for session in ("a", "b", "a", "c"):
        seen.of(session, _messages(1))
    assert list(seen._latest) == ["a", "c"]
