"""A session's record of a turn: its weight versions widen, and its expiry moves with its turns
(pushed back at most once a day: an idle session lives 6-7 days after its last turn)."""

from __future__ import annotations

import time

import redis

from pipeline.core.broker import keys
from pipeline.serve.sessions import SESSION_TTL_S, TTL_REFRESH_S, Pending, Placed, SessionStore, TurnRecord


def _record(store: SessionStore, session_id: str, versions: tuple[int, int]) -> None:
    session = store.get(session_id)  # as a server reads it when the turn begins
    pending = Pending(session.turns, f"{session_id}-t{session.turns}", "req", "msgs", 1, False)
    assert store.claim(session, pending)
    record = TurnRecord(session.turns, pending.turn_id, "req", "msgs", 1, [1, 2], None, [], {})
    store.record(session, pending, record, versions, Placed("w1", "w1", None, prompt_tokens=2, cached_tokens=0))


def test_each_turn_widens_the_sessions_weight_versions(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    session = store.create(run="r", pool="default", output="file:///x", session_id="s-versions")
    for versions in ((4, 4), (2, 3), (6, 7)):
        _record(store, session.session_id, versions)
    got = store.get(session.session_id)
    assert (got.min_version, got.max_version, got.turns, got.pending) == (2, 7, 3, None)


def test_a_turn_pushes_the_expiry_back_once_it_was_set_a_day_ago(redis_client: redis.Redis) -> None:
    store = SessionStore(redis_client)
    key = keys.session("s-ttl")
    store.create(run="r", pool="default", output="file:///x", session_id="s-ttl")
    redis_client.expire(key, 1000)  # marks the expiry set at creation (now)
    _record(store, "s-ttl", (1, 1))
    assert 0 < redis_client.ttl(key) <= 1000  # set less than a day ago: left as it is
    day_ago_ms = int((time.time() - TTL_REFRESH_S - 60) * 1000)
    redis_client.hset(key, "ttl_set_ms", day_ago_ms)
    _record(store, "s-ttl", (1, 1))
    assert redis_client.ttl(key) > SESSION_TTL_S - 60  # a week again from this turn
    assert int(redis_client.hget(key, "ttl_set_ms")) > day_ago_ms
