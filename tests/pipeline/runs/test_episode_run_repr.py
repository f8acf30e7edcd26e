"""`print(run)` of an `EpisodeRun` says which run it is and how far it got, never its Redis connection."""

from __future__ import annotations

import redis

import pipeline
from tests.workers.agents.conftest import agent


def test_an_episode_run_prints_its_name_pool_and_counts(redis_client: redis.Redis) -> None:
    run = pipeline.Client(redis_client).submit_episodes([{"id": "a"}, {"id": "b"}], agent=agent("solve"),
                                                        run="ep-0", n=2)
    shown = repr(run)
    assert shown == (f"EpisodeRun(run='ep-0', pool='default', agent={agent('solve')!r}, episodes=4, "
                     "counts={'submitted': 4, 'queued': 4})")
    assert "Redis" not in shown and "Connection" not in shown
