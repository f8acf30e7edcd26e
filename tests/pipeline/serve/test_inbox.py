"""A server's inbox: the answers of a job's turns, pushed at once by a worker, reach each turn's
waiters, whenever they ask (real redis-server)."""

from __future__ import annotations

import threading
from typing import Any

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import replies
from pipeline.serve.inbox import Inbox


def _push(conn: redis.Redis, server_id: str, *answers: tuple[str, bytes]) -> None:
    with conn.pipeline(transaction=False) as pipe:  # as a worker's commit does: one push for the job
        replies.push(pipe, ((server_id, turn_id, answer) for turn_id, answer in answers))
        pipe.execute()


def test_each_turns_answer_reaches_its_waiters_and_an_early_one_waits_for_its_waiter(
        redis_client: redis.Redis) -> None:
    inbox = Inbox(redis_client)
    try:
        a, b, also_a = inbox.expect("s1-00000-aaa"), inbox.expect("s2-00000-bbb"), inbox.expect("s1-00000-aaa")
        _push(redis_client, inbox.server_id, ("s2-00000-bbb", b"rows of b"), ("s1-00000-aaa", b"rows\nof a"),
              ("s3-00000-ccc", b"rows of c"))  # c's waiter has not asked yet (its worker was fast)
        assert a.result(timeout=10) == also_a.result(timeout=10) == b"rows\nof a"
        assert b.result(timeout=10) == b"rows of b"
        assert inbox.expect("s3-00000-ccc").result(timeout=10) == b"rows of c"
        assert redis_client.llen(keys.serve_inbox(inbox.server_id)) == 0  # all taken
    finally:
        inbox.close()


def test_a_waiter_that_gave_up_leaves_the_answer_to_the_next_one(redis_client: redis.Redis) -> None:
    inbox = Inbox(redis_client)
    try:
        gone = inbox.expect("s1-00001-aaa")
        inbox.forget("s1-00001-aaa", gone)
        _push(redis_client, inbox.server_id, ("s1-00001-aaa", b"rows"))
        assert inbox.expect("s1-00001-aaa").result(timeout=10) == b"rows"  # the caller's retry gets it
        assert not gone.done()
    finally:
        inbox.close()


class _FarRedis(redis.Redis):
    """Redis on another host whose every LPOP answer is late: it comes once `arrives` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.arrives = threading.Event()

    def lpop(self, *args: Any, **kwargs: Any) -> Any:
        self.arrives.wait(60)
        return super().lpop(*args, **kwargs)


def test_an_answer_reaches_its_waiter_without_waiting_on_another_round_trip(redis_client: redis.Redis) -> None:
    """A lone turn's answer, taken by the BLPOP, goes to its waiter at once, not once the LPOP that
    takes whatever else waits has answered (a round trip more per turn with Redis on another host)."""
    far = _FarRedis(connection_pool=redis_client.connection_pool)
    inbox = Inbox(far)
    try:
        answer = inbox.expect("s1-00002-aaa")
        _push(redis_client, inbox.server_id, ("s1-00002-aaa", b"rows"))
        assert answer.result(timeout=30) == b"rows"
    finally:
        far.arrives.set()
        inbox.close()
