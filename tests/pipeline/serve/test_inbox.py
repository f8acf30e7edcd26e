"""A server's inbox: the answers of a job's turns, pushed at once by a worker, reach each turn's
waiters, whenever they ask (real redis-server)."""

from __future__ import annotations

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
