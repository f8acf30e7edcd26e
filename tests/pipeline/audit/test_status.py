"""`pipeline status`: per-run staleness against the pool's latest pushed weights; jobs waiting to retry."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import redis

import pipeline
from pipeline.audit.status import collect, format_sessions, format_status, open_sessions
from pipeline.cli.main import main
from pipeline.core.broker import commit_log, keys, registry
from pipeline.core.errors import UnknownRunError
from pipeline.core.jobs import turn_queue
from pipeline.core.jobs.queue import JOB_FUNCTION, rollout_queue
from pipeline.core.jobs.turn_queue import TURNS
from pipeline.serve.sessions import Pending, Placed, Session, SessionStore, TurnRecord
from schemas.worker_info import WorkerInfo
from tests.helpers.turn_jobs import push, turn_job


def test_runs_show_how_far_their_oldest_tokens_are_behind_the_pushed_version(redis_client: redis.Redis) -> None:
    redis_client.sadd(keys.pool(None).runs, "r")
    for job, version in (("j1", 1), ("j2", 3)):
        commit_log.append(redis_client, "r", commit_log.Commit(job_id=job, batch_id="b", url=f"file:///x/{job}",
                                                                rows=4, tokens=40, weight_version=version))
    pipeline.Client(redis_client).push_weights("/ckpt/4", version=4, timeout=1)
    status = collect(redis_client)
    run = status["pools"]["default"]["runs"]["r"]
    assert run["weight_versions"] == [1, 3] and run["staleness"] == 3
    assert "staleness 3 (oldest token v1 vs pushed v4)" in format_status(status)


def test_rewards_say_how_many_shards_were_scored_and_how_many_failed(redis_client: redis.Redis) -> None:
    from pipeline.core.broker import reward_log

    redis_client.sadd(keys.pool(None).runs, "rw")
    redis_client.sadd(keys.REWARD_RUNS, "rw")
    for job in ("j1", "j2", "j3", "j4"):
        commit_log.append(redis_client, "rw", commit_log.Commit(job_id=job, batch_id="b", url=f"file:///x/{job}",
                                                                 rows=2, tokens=8, weight_version=0))
    for job in ("j1", "j2", "j3"):
        reward_log.append(redis_client, "rw", reward_log.RewardCommit(job, "", 0, error="ValueError: no answer"))
    reward_log.append(redis_client, "rw", reward_log.RewardCommit("j4", "file:///x/j4.rewards.parquet", 2), 1.0, 1, 0)
    status = collect(redis_client)
    assert status["pools"]["default"]["runs"]["rw"]["rewards"]["scored"] == 1
    assert "rewards: 1/4 shards scored, 3 failed" in format_status(status)


def test_status_of_an_unknown_run_is_an_error_naming_the_runs(
    redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    redis_client.sadd(keys.pool(None).runs, "tiny-step1")
    with pytest.raises(UnknownRunError, match="runs submitted here: tiny-step1; did you mean 'tiny-step1'"):
        collect(redis_client, run="tiny-stpe1")
    assert list(collect(redis_client, run="tiny-step1")["pools"]["default"]["runs"]) == ["tiny-step1"]
    url = redis_client.connection_pool.connection_kwargs
    monkeypatch.setenv("PIPELINE_REDIS_URL", f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}")
    assert main(["status", "--run", "tiny-stpe1"]) == 1
    assert "error: no run 'tiny-stpe1' was submitted to any pool" in capsys.readouterr().err


def test_a_heartbeat_from_a_clock_ahead_is_never_negative(redis_client: redis.Redis) -> None:
    ahead = time.time() + 5  # a worker host whose clock runs ahead
    registry.publish(redis_client, WorkerInfo(worker_id="w", host="h", pid=1, engine="fake", model="m",
                                              started_at=ahead, heartbeat_at=ahead), ttl_s=30)
    status = collect(redis_client)
    assert status["pools"]["default"]["workers"][0]["heartbeat_age_s"] == 0.0
    assert "heartbeat=0.0s ago" in format_status(status) and "-" not in format_status(status).split("heartbeat=")[1][:2]


def test_jobs_waiting_out_their_retry_backoff_are_shown(redis_client: redis.Redis) -> None:
    queue = rollout_queue(redis_client)
    queue.enqueue_in(timedelta(minutes=5), JOB_FUNCTION, {"n": 1})  # where RQ puts a retry with an interval
    status = collect(redis_client)
    assert status["pools"]["default"]["queue"]["retrying"] == 1
    assert "0 queued, 1 waiting to retry, 0 running, 0 failed" in format_status(status)


def _turn(store: SessionStore, session: Session, turn: int, versions: tuple[int, int],
          prefix_break: bool = False) -> None:
    """Record one turn of `session` as a server does once its rows are back (the session as read when
    the turn began)."""
    session = store.get(session.session_id)
    pending = Pending(f"{turn:06x}", f"req{turn}", "", 1 + turn)
    assert store.open(session.session_id, same=None, claim=pending, pool=session.pool).turn == turn
    record = TurnRecord(turn, pending.turn_id(session.session_id, turn), f"req{turn}", "", 1 + turn, [1, 2, 3],
                        None, [], {})
    store.record(session, record, versions, Placed("w1", "w1", None, prompt_tokens=3, cached_tokens=0),
                 None, None, prefix_break=prefix_break)


def test_status_shows_the_lane_open_sessions_their_versions_and_each_runs_agent_turns(
    redis_client: redis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = SessionStore(redis_client)
    sessions = [store.create(run="agents", pool="default", output="file:///x") for _ in range(4)]
    _turn(store, sessions[0], 0, (3, 3))
    _turn(store, sessions[0], 1, (4, 5), prefix_break=True)  # the weights moved during this episode
    _turn(store, sessions[1], 0, (4, 4))
    _turn(store, sessions[2], 0, (3, 4))
    _turn(store, sessions[2], 1, (4, 4))
    ended = store.create(run="agents", pool="default", output="file:///x")
    _turn(store, ended, 0, (1, 1))  # an ended session's versions are not the open sessions'
    store.end(ended.session_id)
    store.create(run="other", pool="p2", output="file:///x")  # another pool's session
    turn_queue.register(redis_client, keys.pool(None), "w1")
    for job_id in ("lane-a", "lane-b", "lane-c"):  # three in the shared lane, of which w1 took one
        push(redis_client, None, turn_job(job_id, f"turn-{job_id}"))
    TURNS.read_new(redis_client, [keys.pool(None).lane], "w1", 1, None)
    for job_id in ("own-1", "own-2", "own-3"):  # three routed to worker w1, which took one
        push(redis_client, "w1", turn_job(job_id, f"turn-{job_id}"))
    TURNS.read_new(redis_client, [keys.pool(None).turn_queue("w1")], "w1", 1, None)
    redis_client.sadd(keys.pool(None).runs, "batch-only")

    status = collect(redis_client, pool="default")
    pool = status["pools"]["default"]
    assert pool["turns"] == {"lane": "pipeline:lane", "lane_queued": 2, "lane_taken": 1, "routed": 2, "taken": 1}
    assert pool["sessions"] == {"open": 4, "read": 4, "capped": False, "expired": 0, "with_versions": 3,
                                "no_turn_yet": 1, "weight_versions": [3, 5], "mixed_versions": 2}
    assert pool["runs"]["agents"]["agent_turns"] == {"turns": 6, "prefix_breaks": 1}
    assert pool["runs"]["batch-only"]["agent_turns"] is None
    text = format_status(status)
    assert ("agent turns: 2 job(s) waiting in the shared lane pipeline:lane (1 running); workers' turn queues: "
            "2 waiting, 1 running") in text
    assert ("agent sessions: 4 open session(s) over weight versions 3..5 (2 with turns on more than one version, "
            "1 with no turn yet)") in text
    assert "agents: 0 shards, 0 rows, 0 completion tokens, weights [], 6 agent turns, 1 prefix breaks" in text
    assert "  batch-only: 0 shards, 0 rows, 0 completion tokens, weights []" in text.splitlines()  # no agent turn

    other = collect(redis_client, pool="p2")["pools"]["p2"]
    assert other["sessions"]["open"] == 1 and other["sessions"]["weight_versions"] is None
    assert other["turns"] == {"lane": "pipeline:pool:p2:lane", "lane_queued": 0, "lane_taken": 0, "routed": 0,
                              "taken": 0}
    assert "agent sessions: 1 open session(s) (1 with no turn yet)" in format_status({"pools": {"p2": other}})

    url = redis_client.connection_pool.connection_kwargs
    monkeypatch.setenv("PIPELINE_REDIS_URL", f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}")
    assert main(["status", "--pool", "default", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["pools"]["default"]
    assert shown["sessions"]["weight_versions"] == [3, 5] and shown["turns"]["lane_queued"] == 2
    assert shown["runs"]["agents"]["agent_turns"] == {"turns": 6, "prefix_breaks": 1}


def test_a_run_without_prefix_breaks_says_zero_and_expired_or_many_sessions_are_said(
    redis_client: redis.Redis,
) -> None:
    store = SessionStore(redis_client)
    sessions = [store.create(run="clean", pool="default", output="file:///x") for _ in range(5)]
    for session in sessions:
        _turn(store, session, 0, (7, 7))
    redis_client.delete(keys.session(sessions[0].session_id))  # expired: its id is still in the open set
    status = collect(redis_client)
    pool = status["pools"]["default"]
    assert pool["sessions"]["expired"] == 1 and pool["sessions"]["weight_versions"] == [7, 7]
    text = format_status(status)
    assert "clean: 0 shards, 0 rows, 0 completion tokens, weights [], 5 agent turns, 0 prefix breaks" in text
    assert "agent sessions: 5 open session(s) over weight version 7 (1 whose state has expired)" in text

    few = open_sessions(redis_client, "default", limit=2)
    assert few["open"] == 5 and few["read"] == 2 and few["capped"]
    assert "counts and versions from a random 2 of them" in format_sessions(few)
