"""`read_trajectories` by run name: a run this Redis never had is an error naming the runs it has,
not an empty table a trainer would silently train on."""

from __future__ import annotations

import pytest
import redis

import pipeline
from pipeline.core.broker import keys


def test_a_mistyped_run_is_refused_naming_the_runs_there(redis_client: redis.Redis) -> None:
    redis_client.sadd(keys.pool(None).runs, "agents-0")
    with pytest.raises(pipeline.UnknownRunError, match=r"'agents-O'.*agents-0.*did you mean 'agents-0'"):
        pipeline.read_trajectories("agents-O", conn=redis_client)


def test_a_run_with_no_turn_yet_reads_as_empty(redis_client: redis.Redis) -> None:
    redis_client.sadd(keys.pool(None).runs, "agents-1")  # a session opened, nothing generated yet
    table = pipeline.read_trajectories("agents-1", conn=redis_client)
    assert table.num_rows == 0
