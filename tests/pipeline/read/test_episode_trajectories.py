"""Which episode attempts every trajectory reader returns, by one rule (`episodes.trained`): the
committed attempt of each episode, of tasks none of whose episodes was canceled; never an attempt
that was canceled and finished late, nor the finished half of a group a cancel cut. Driven at the
episode contract (a real Redis, no workers): each attempt's turn is logged as a worker logs it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest
import redis

import pipeline
from pipeline.audit.report_episodes import episodes_section
from pipeline.core.broker import keys
from pipeline.core.jobs import episodes
from pipeline.core.jobs.episodes import Claimed
from pipeline.core.jobs.turn_log import ROWS, TURN
from pipeline.serve.api_error import APIError
from pipeline.serve.sessions import Pending, SessionStore
from schemas.episode import EpisodeOutcome
from schemas.shard import SHARD_SCHEMA, rows_to_ipc
from schemas.turn_id import TurnId
from tests.pipeline.audit.test_report import Page

AGENT = "tests.helpers.agents:solve"


def _log_turn(conn: redis.Redis, run: str, session_id: str, turn: int = 0) -> None:
    """A root turn of the session in the run's turn log, as a worker logs it (prompt [1, 2], completion [3])."""
    row = {"session_id": session_id, "turn": turn, "sample_index": 0, "prompt_token_ids": [1, 2],
           "completion_token_ids": [3], "completion_logprobs": [-0.5], "weight_version": 0,
           "weight_version_segments": None, "prefix_break": turn > 0, "finished_at": datetime.now(UTC),
           "worker_id": "w", "prompt_tokens": 2, "cached_tokens": 0}
    table = pa.Table.from_pylist([row], schema=pa.schema([SHARD_SCHEMA.field(name) for name in row]))
    conn.xadd(keys.turn_log(run), {TURN: f"{session_id}-{turn:05d}", ROWS: rows_to_ipc(table)})


def _start(conn: redis.Redis, store: SessionStore, claimed: Claimed) -> str:
    """An attempt of the claimed episode begun, its session opened and one turn of it logged."""
    job = claimed.job
    session_id = f"s-{job.task_id}-{job.sample}"
    store.create(run=job.run, pool=keys.pool(None).name, output="memory://unused", session_id=session_id)
    assert episodes.start_attempt(conn, job, session_id=session_id, worker_id="w", trace_id="t", started_at_ms=0)
    _log_turn(conn, job.run, session_id)
    return session_id


def _finish(conn: redis.Redis, store: SessionStore, claimed: Claimed, session_id: str, reward: float = 0.0,
            info: dict[str, Any] | None = None) -> bool:
    """The attempt ends as an agent worker ends it: the reward on the session, then the commit."""
    store.reward(session_id, {"reward": reward})
    store.end(session_id)
    job = claimed.job
    return episodes.commit(conn, claimed, EpisodeOutcome(
        episode_id=job.episode_id, task_id=job.task_id, sample=job.sample, status="finished", reward=reward,
        session_id=session_id, attempts=1, turns=1, trace_id="t", worker_id="w", started_at_ms=0, finished_at_ms=1,
        info=info or {}))


def test_after_take_every_reader_returns_the_taken_groups_whole_and_nothing_canceled(
        redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    run = client.submit_episodes([{"id": "a"}, {"id": "b"}, {"id": "c"}], agent=AGENT, run="late", n=2)
    store = SessionStore(redis_client)
    stream = keys.pool(None).episode_stream(AGENT)
    claimed = {f"{c.job.task_id}:{c.job.sample}": c
               for c in episodes.STREAMS.read_new(redis_client, [stream], "w", 10, None)}
    sessions = {episode: _start(redis_client, store, c) for episode, c in claimed.items()}
    # Task a's group ends whole; b:0 ends, b:1 and task c are in flight when the trainer takes one group.
    for episode in ("a:0", "a:1", "b:0"):
        assert _finish(redis_client, store, claimed[episode], sessions[episode])

    taken = run.take(1, timeout=10)
    assert [g.column("task_id").to_pylist() for g in taken.groups] == [["a", "a"]] and taken.canceled == 3

    # The canceled attempts' sessions ended with the cancel: no further turn of them starts.
    for episode in ("b:1", "c:0", "c:1"):
        session = store.get(sessions[episode])
        assert session.state == "ended"
        with pytest.raises(APIError, match="has ended") as refused:
            store.open(sessions[episode], same=None, claim=Pending("00001a", "d", "", 2), pool="default")
        assert refused.value.status == 409
    # Two of them finish before their worker sees the cancel: their commits are refused, and counted
    # as nothing (no duplicate: no worker died), though their sessions hold a reward (0.0) and turns.
    assert not _finish(redis_client, store, claimed["b:1"], sessions["b:1"])
    assert not _finish(redis_client, store, claimed["c:0"], sessions["c:0"])
    counts = run.counts()
    assert (counts["finished"], counts["canceled"], counts["duplicates"]) == (3, 3, 0)

    taken_sessions = sorted([sessions["a:0"], sessions["a:1"]])
    plain = pipeline.read_trajectories("late", conn=redis_client)
    assert sorted(plain.column("session_id").to_pylist()) == taken_sessions
    assert plain.column("task_id").to_pylist() == ["a", "a"] and plain.column("reward").to_pylist() == [0.0, 0.0]
    assert json.loads(plain.column("rewards")[0].as_py()) == {"reward": 0.0}
    groups = pipeline.read_trajectories("late", conn=redis_client, groups=True)
    assert [g.column("session_id").to_pylist() for g in groups] == [taken_sessions]
    assert sorted(run.trajectories().column("session_id").to_pylist()) == taken_sessions
    assert [g.column("task_id").to_pylist() for g in run.groups()] == [["a", "a"]]

    from pipeline import RolloutBatches

    batches = list(RolloutBatches("late", conn=redis_client, trajectories=True, batch_size=8))
    assert sorted(s for batch in batches for s in batch["session_id"]) == taken_sessions
    # The raw turns stay visible for inspection: every attempt's session was served and logged.
    served = pipeline.read_trajectories(pipeline.read.lineage_rows.turn_rows("late", redis_client))
    assert sorted(served.column("session_id").to_pylist()) == sorted(sessions.values())
    # The report's episodes section counts what the readers return.
    (overview,) = Page(episodes_section(redis_client, "late") or "").table_with("in training")
    assert (overview["in training"], overview["finished"], overview["canceled"], overview["duplicates"]) == (
        "2", "3", "3", "0")


def test_an_episode_is_one_row_per_lineage_each_with_the_reward_the_agent_gave_it(redis_client: redis.Redis) -> None:
    client = pipeline.Client(redis_client)
    client.submit_episodes([{"id": "a"}], agent=AGENT, run="trees", n=2)
    store = SessionStore(redis_client)
    stream = keys.pool(None).episode_stream(AGENT)
    claimed = sorted(episodes.STREAMS.read_new(redis_client, [stream], "w", 10, None), key=lambda c: c.job.sample)
    sessions = [_start(redis_client, store, c) for c in claimed]
    for session in sessions:  # a second root: a sub-agent, or a compacted history
        _log_turn(redis_client, "trees", session, turn=1)
    # Sample 0's agent returned a reward for its sub-agent's lineage beside the episode's.
    sub_agent = f"chatcmpl-{TurnId(sessions[0], 1, 'abcdef')}"
    assert _finish(redis_client, store, claimed[0], sessions[0], 1.0, {"lineage_rewards": {sub_agent: 0.25}})
    # Sample 1's harness recorded rewards per lineage on its session (the reward dict, stored as JSON).
    assert _finish(redis_client, store, claimed[1], sessions[1], 1.0)
    redis_client.hset(keys.session(sessions[1]), "reward",
                      json.dumps({"reward": 1.0, "lineage_rewards": {str(TurnId(sessions[1], 0, "abcdef")): -1.0}}))

    (group,) = pipeline.read_trajectories("trees", conn=redis_client, groups=True)
    rows = [(r["sample"], r["lineage"], r["lineages"], r["turns"], r["reward"]) for r in group.to_pylist()]
    assert rows == [(0, 0, 2, [0], 1.0), (0, 1, 2, [1], 0.25), (1, 0, 2, [0], -1.0), (1, 1, 2, [1], 1.0)]
