"""A session's tree of calls in Redis: calls claimed concurrently, each placed under the call it
extends (the longest; ties to the lowest turn), retries finding their call, the size limit, weight
versions widening, and the expiry moving with the calls (pushed back at most once a day)."""

from __future__ import annotations

import time

import pytest
import redis

from pipeline.core.broker import keys
from pipeline.serve.api_error import APIError
from pipeline.serve.conversation import Conversation
from pipeline.serve.sessions import (
    SESSION_TTL_S,
    TTL_REFRESH_S,
    Choice,
    Opened,
    Pending,
    Placed,
    SessionStore,
    TurnRecord,
)

USER = {"role": "user", "content": "hi"}


def _reply(text: str) -> dict[str, object]:
    return {"content": text, "tool_calls": []}


def _open(store: SessionStore, session_id: str, pending: Pending, *, retry: bool = False,
          reply_keys: list[str] | None = None) -> Opened:
    """Open a call as a server does: read what it needs and claim it (a retry: unless its body's call stands)."""
    return store.open(session_id, same=pending.request_digest if retry else None, claim=pending, pool="default",
                      reply_keys=reply_keys or [])


def _commit(store: SessionStore, session_id: str, messages: list[dict[str, object]], prompt: list[int],
            replies: list[tuple[list[int], str]], *, digest: str, versions: tuple[int, int] = (1, 1),
            parent: tuple[int, int] | None = None) -> int:
    """Claim and record a chat call of `messages` (its prompt ids `prompt`), one choice per reply."""
    conversation = Conversation(messages)
    pending = Pending("abcdef", digest, conversation.whole(), len(messages))
    opened = _open(store, session_id, pending)
    turn = opened.turn
    assert turn is not None
    choices = [Choice(ids, text, _reply(text)) for ids, text in replies]
    record = TurnRecord(turn, pending.turn_id(session_id, turn), digest, conversation.whole(), len(messages), prompt,
                        None, choices, {"id": digest}, parent, "w1")
    store.record(opened.session, record, versions, Placed("w1", "w1", None, prompt_tokens=len(prompt),
                                                          cached_tokens=0), conversation, None, prefix_break=False)
    return turn


def _lookup(store: SessionStore, session_id: str, messages: list[dict[str, object]]) -> Opened:
    """A call of `messages` opened (and claimed) as a server opens it."""
    return _open(store, session_id, Pending("123456", f"look{len(messages)}", "", len(messages)),
                 reply_keys=_reply_keys(messages))


def _reply_keys(messages: list[dict[str, object]]) -> list[str]:
    conversation = Conversation(messages)
    return [conversation.reply_key(j, _reply(str(messages[j]["content"])))
            for j in range(len(messages) - 2, -1, -1) if messages[j]["role"] == "assistant"]


def test_a_call_is_placed_under_the_longest_call_it_extends(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///x", session_id="s-tree")
    first = _commit(store, "s-tree", [USER], [1, 2], [([3], "a"), ([4], "b")], digest="d0")
    history = [USER, {"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}]
    second = _commit(store, "s-tree", history, [1, 2, 4, 5], [([6], "c")], digest="d1", parent=(first, 1))
    # A call that continues the second call's reply extends it (not the first, which it also extends).
    longer = [*history, {"role": "assistant", "content": "c"}, {"role": "user", "content": "on"}]
    opened = _lookup(store, "s-tree", longer)
    assert opened.parent is not None and (opened.parent.turn, opened.parent.sample) == (second, 0)
    assert opened.parent.ids.tolist() == [1, 2, 4, 5, 6]
    # The sample sent back decides: the first call's sample 0 ("a") is another branch.
    branch = [USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "other"}]
    opened = _lookup(store, "s-tree", branch)
    assert opened.parent is not None and (opened.parent.turn, opened.parent.sample) == (first, 0)
    # A conversation that extends no call is a root.
    assert _lookup(store, "s-tree", [{"role": "user", "content": "x"}]).parent is None
    # By tokens: the longest committed prompt + completion the ids start with.
    assert store.parent_by_tokens("s-tree", [1, 2, 4, 5, 6, 7], None).turn == second  # type: ignore[union-attr]
    assert store.parent_by_tokens("s-tree", [1, 2, 3, 9], None).sample == 0  # type: ignore[union-attr]
    assert store.parent_by_tokens("s-tree", [1, 2, 4, 5, 6], None).turn == first  # no new token: not the second


def test_two_identical_calls_index_the_lowest_turn(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///x", session_id="s-tie")
    # Claimed in order 0, 1 but committed 1 first: the lower turn still wins the index.
    pendings = [Pending("abcdef", f"d{i}", "", 1) for i in range(2)]
    opened = [_open(store, "s-tie", p) for p in pendings]
    assert [o.turn for o in opened] == [0, 1] and store.get("s-tie").in_flight == 2  # both in flight at once
    for turn in (1, 0):
        record = TurnRecord(turn, pendings[turn].turn_id("s-tie", turn), f"d{turn}", Conversation([USER]).whole(), 1,
                            [1], None, [Choice([2], "same", _reply("same"))], {}, None, "w1")
        store.record(opened[turn].session, record, (1, 1), Placed("w1", None, None, 1, 0), Conversation([USER]),
                     None, prefix_break=False)
    later = [USER, {"role": "assistant", "content": "same"}, {"role": "user", "content": "next"}]
    placed = _lookup(store, "s-tie", later)
    assert placed.parent is not None and placed.parent.turn == 0
    assert store.parent_by_tokens("s-tie", [1, 2, 3], None).turn == 0  # type: ignore[union-attr]
    assert placed.session.in_flight == 0 and placed.session.turns == 2  # as read before its own claim


def test_a_retry_finds_its_call_and_a_racing_retry_waits_for_it(redis_client: redis.Redis) -> None:
    """The lookup and the claim are one script: of an original and a retry racing it, whichever runs
    first claims the call and the other finds it in flight (never two calls of one body)."""
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///x", session_id="s-retry")
    original = Pending("abcdef", "body", "", 1)
    turn = _open(store, "s-retry", original, retry=True).turn
    retried = _open(store, "s-retry", Pending("123456", "body", "", 1), retry=True)
    assert retried.turn is None and retried.same == (turn, None, original)
    assert store.get("s-retry").calls == 1
    # A call that says it is new (not a retry) is a call of its own, even with the same body.
    assert _open(store, "s-retry", Pending("fedcba", "body", "", 1)).turn == turn + 1
    # Released (its job failed), the call no longer stands for a retry: the retry is claimed anew.
    store.release("s-retry", turn + 1, Pending("fedcba", "body", "", 1))
    assert _open(store, "s-retry", Pending("0a0a0a", "body", "", 1), retry=True).turn == turn + 2


def test_a_session_past_its_limit_of_calls_is_refused_and_keeps_its_calls(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client, max_calls=2)
    store.create(run="r", pool="default", output="file:///x", session_id="s-limit")
    for i in range(2):
        _commit(store, "s-limit", [USER], [1], [([2], "x")], digest=f"d{i}")
    with pytest.raises(APIError) as refused:
        _open(store, "s-limit", Pending("abcdef", "d9", "", 1))
    assert refused.value.status == 413 and refused.value.code == "session_too_large"
    assert "2 calls" in refused.value.message and "--max-session-calls" in refused.value.message
    assert store.get("s-limit").turns == 2 and redis_client.hexists(keys.session_calls("s-limit"), "r:1")


def test_each_call_widens_the_sessions_weight_versions(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///x", session_id="s-versions")
    for i, versions in enumerate(((4, 4), (2, 3), (6, 7))):
        _commit(store, "s-versions", [USER], [1], [([2], "x")], digest=f"d{i}", versions=versions)
    got = store.get("s-versions")
    assert (got.min_version, got.max_version, got.turns, got.in_flight) == (2, 7, 3, 0)


def test_a_call_pushes_the_expiry_back_once_it_was_set_a_day_ago(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    key = keys.session("s-ttl")
    store.create(run="r", pool="default", output="file:///x", session_id="s-ttl")
    redis_client.expire(key, 1000)  # marks the expiry set at creation (now)
    _commit(store, "s-ttl", [USER], [1], [([2], "x")], digest="d0")
    assert 0 < redis_client.ttl(key) <= 1000  # set less than a day ago: left as it is
    assert 0 < redis_client.ttl(keys.session_calls("s-ttl")) <= 1000  # its calls expire with it
    day_ago_ms = int((time.time() - TTL_REFRESH_S - 60) * 1000)
    redis_client.hset(key, "ttl_set_ms", day_ago_ms)
    _commit(store, "s-ttl", [USER], [1], [([2], "x")], digest="d1")
    assert redis_client.ttl(key) > SESSION_TTL_S - 60  # a week again from this call
    assert redis_client.ttl(keys.session_calls("s-ttl")) > SESSION_TTL_S - 60
    assert int(redis_client.hget(key, "ttl_set_ms")) > day_ago_ms


def test_a_sessions_calls_and_ends_expire_with_it_from_its_first_claim(redis_client: redis.Redis) -> None:
    """The first claim gives the calls their expiry (a server that dies before recording leaves none
    forever); a record gives the ends theirs and moves both with the session's."""
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///x", session_id="s-exp")
    redis_client.expire(keys.session("s-exp"), 1000)
    _open(store, "s-exp", Pending("abcdef", "d0", "", 1))  # claimed, never recorded
    assert 0 < redis_client.ttl(keys.session_calls("s-exp")) <= 1000
    redis_client.expire(keys.session("s-exp"), 2000)  # as a record a day later pushes it back
    _commit(store, "s-exp", [USER], [1], [([2], "x")], digest="d1")
    for key in (keys.session_calls("s-exp"), keys.session_ends("s-exp")):
        assert 1000 < redis_client.ttl(key) <= 2000
    _open(store, "s-exp", Pending("abcdef", "d2", "", 1))  # a later claim leaves them as the record set them
    assert 1000 < redis_client.ttl(keys.session_calls("s-exp")) <= 2000


def test_a_later_reward_keeps_the_rewards_it_does_not_name(redis_client: redis.Redis) -> None:
    """A harness posts a sub-agent's lineage reward mid-episode; the agent worker then ends the session
    with the episode's reward: both stay, and a second lineage reward joins the first."""
    store = SessionStore(redis_client)
    store.create(run="r", pool="default", output="file:///tmp/x", session_id="s-reward")
    store.reward("s-reward", {"lineage_rewards": {"chatcmpl-a": 0.25}})
    store.reward("s-reward", {"reward": 1.0, "lineage_rewards": {"chatcmpl-b": 0.5}})
    store.reward("s-reward", {"rewards": {"format": 0.1}})
    assert store.get("s-reward").reward == {"reward": 1.0, "format": 0.1,
                                            "lineage_rewards": {"chatcmpl-a": 0.25, "chatcmpl-b": 0.5}}
    with pytest.raises(APIError, match="finite number"):
        store.reward("s-reward", {"reward": float("nan")})
    assert store.get("s-reward").reward["reward"] == 1.0
