"""Episodes an agent worker stops on shutdown are handed back, not abandoned: another worker takes
them at once (not after `--claim-after`) and the counts say "handed back"; the session of an attempt
a dead worker left behind stops counting as open once its episode runs again."""

from __future__ import annotations

import threading
from pathlib import Path

import redis

import pipeline
from pipeline.core import agents
from pipeline.core.broker import keys
from pipeline.core.jobs import episodes
from pipeline.serve.server import Server
from pipeline.serve.sessions import SessionStore
from tests.helpers.agents import events
from tests.helpers.processes import drive_worker, wait_until
from tests.workers.agents.conftest import agent
from workers.agents.worker import AgentWorker
from workers.engines.fake import FakeEngine

NEVER_S = 600.0  # --claim-after: no episode is taken over for being idle within the test


def test_a_stopped_workers_episodes_are_handed_back_and_taken_at_once(
        redis_client: redis.Redis, server: Server, events_file: Path) -> None:
    run = pipeline.Client(redis_client).submit_episodes([{"id": "a"}, {"id": "b"}], agent=agent("hangs_first"),
                                                        run="ep-0")
    loaded = {agent("hangs_first"): agents.load(agent("hangs_first"))}

    def driver() -> None:
        first = AgentWorker(redis_client, loaded, serve_url=server.url, grace_s=0, claim_after_s=NEVER_S)
        thread = threading.Thread(target=first.work)
        thread.start()
        wait_until(lambda: len([e for e in events(events_file) if "hung" in e]) == 2, 60, "two episodes in flight")
        assert first._loop is not None
        first._loop.call_soon_threadsafe(first.request_stop)  # as a first SIGTERM
        thread.join(60)
        assert not thread.is_alive()
        second = AgentWorker(redis_client, loaded, serve_url=server.url, claim_after_s=NEVER_S)
        thread = threading.Thread(target=second.work)
        thread.start()
        try:
            wait_until(lambda: run.counts()["finished"] == 2, 60, "the handed-back episodes run by another worker")
        finally:
            wait_until(lambda: second._loop is not None, 60, "the second worker's loop")
            second._loop.call_soon_threadsafe(second.request_stop)  # type: ignore[union-attr]
            thread.join(60)
        assert second.stats.taken_over == 2

    drive_worker(redis_client, FakeEngine(), driver, stop_when_done=True)
    counts = run.counts()
    assert (counts["finished"], counts["handed_back"], counts["abandoned"], counts["retried"]) == (2, 2, 0, 0)
    assert redis_client.scard(keys.pool(None).open_sessions) == 0


def test_the_session_of_an_attempt_a_dead_worker_left_is_no_longer_open(redis_client: redis.Redis) -> None:
    """A take-over discards the dead worker's session: counted as abandoned, and no longer open."""
    run = pipeline.Client(redis_client).submit_episodes([{"id": "a"}], agent=agent("solve"), run="ep-1")
    stream = keys.pool(None).episode_stream(agent("solve"))
    (claimed,) = episodes.STREAMS.read_new(redis_client, [stream], "dead", 1, None)
    store = SessionStore(redis_client)
    for session_id, worker in (("ep-dead", "dead"), ("ep-alive", "alive")):
        store.create(run="ep-1", pool="default", output="file:///x", session_id=session_id)
        episodes.start_attempt(redis_client, claimed.job, session_id=session_id, worker_id=worker, trace_id="t",
                               started_at_ms=0)
    assert redis_client.smembers(keys.pool(None).open_sessions) == {b"ep-alive"}
    assert run.counts()["abandoned"] == 1 and run.counts()["handed_back"] == 0
    assert "ep-dead" in episodes.discarded_sessions(redis_client, "ep-1")
