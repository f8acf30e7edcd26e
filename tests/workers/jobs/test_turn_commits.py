"""The turn log: a turn's rows are logged once, flushed to a shard, and still found by a waiter
whose reply was lost (real redis-server, real Parquet)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import turn_queue
from pipeline.serve.dispatch import TurnDispatch
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from tests.helpers.turn_jobs import SERVER, answers
from workers.engines.fake import FakeEngine
from workers.jobs.turn_commits import commit_turns, flush_turns
from workers.rows.table import RowContext, build_table


def _turn(conn: redis.Redis, tmp_path: Path, turn_id: str, *, session: str = "s-1",
          num_experts: int | None = None) -> tuple[JobPayload, list[RolloutRequest], pa.Table]:
    request = RolloutRequest(id=f"{session}:2", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    tag = TurnTag(turn_id=turn_id, session_id=session, turn=2, prefix_break=False, reply_to=SERVER)
    job = JobPayload.pack([request], run="agents", job_id="lane-1", batch_id="lane-1",
                          output=f"file://{tmp_path}/shards", submitted_at_ms=int(time.time() * 1000), turns=[tag])
    now = datetime.now(UTC)
    outputs = FakeEngine().generate([request])
    table = build_table([request], outputs, RowContext("agents", "lane-1", "fake", "m", "w1", 0, now, now, now,
                                                       num_experts=num_experts, turns=[tag]))
    conn.set(keys.turn_log_output("agents"), f"file://{tmp_path}/shards")
    return job, [request], table


def test_a_lost_reply_is_read_back_from_the_shard_and_a_rerun_logs_nothing(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    turn_id = "s-1-00002-abcdef"
    job, requests, table = _turn(redis_client, tmp_path, turn_id)
    assert commit_turns(job, requests, table, redis_client)["logged"] == 1
    redis_client.delete(keys.serve_inbox(SERVER))  # the answer went to a server that is gone
    assert flush_turns(redis_client, "agents", force=True) is not None  # then the log was flushed
    # The job finished; a waiter (the agent's retry) finds the rows in the shard the turn went to.
    redis_client.set(keys.turn_job(turn_id), turn_queue.turn_job_value("turns-1", "w1"))
    dispatch = TurnDispatch(redis_client, "default", turn_timeout_s=10)
    got = asyncio.run(dispatch.wait_async(turn_id, "agents", time.monotonic(), settled=lambda: None))
    assert got.column("completion_token_ids").to_pylist() == table.column("completion_token_ids").to_pylist()
    assert got.column("session_id").to_pylist() == ["s-1"] and got.column("turn").to_pylist() == [2]
    # The job run again (its worker looked dead) logs nothing new: the turn has one row.
    assert commit_turns(job, requests, table, redis_client)["logged"] == 0
    assert redis_client.xlen(keys.turn_log("agents")) == 0


def test_a_job_run_twice_at_once_logs_each_turn_once_and_both_runs_answer_the_rows_logged_first(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    turn_id = "s-1-00002-abcdef"
    job, requests, table = _turn(redis_client, tmp_path, turn_id)
    assert commit_turns(job, requests, table, redis_client)["logged"] == 1
    assert redis_client.sismember(keys.TURN_RUNS, "agents")  # so a flusher looks at the run's log
    first = answers(redis_client)[turn_id]
    assert redis_client.llen(keys.serve_inbox(SERVER)) == 0
    # The same item, moved to the shared lane while its worker still ran it, run again elsewhere.
    again = table.set_column(table.schema.get_field_index("worker_id"), "worker_id", pa.array(["w2"]))
    assert commit_turns(job, requests, again, redis_client)["logged"] == 0
    assert answers(redis_client)[turn_id] == first
    assert redis_client.xlen(keys.turn_log("agents")) == 1


def test_turn_rows_read_during_a_flush_see_each_turn_once(redis_client: redis.Redis, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.read import lineage_rows

    job, requests, table = _turn(redis_client, tmp_path, "s-1-00002-abcdef")
    commit_turns(job, requests, table, redis_client)
    real_read = lineage_rows.read_rollouts

    def read_then_flush(*args: Any, **kwargs: Any) -> Any:  # a flusher moves the log to a shard meanwhile
        got = real_read(*args, **kwargs)
        assert flush_turns(redis_client, "agents", force=True) is not None
        return got

    monkeypatch.setattr(lineage_rows, "read_rollouts", read_then_flush)
    assert lineage_rows.turn_rows("agents", redis_client).num_rows == 1
    monkeypatch.setattr(lineage_rows, "read_rollouts", real_read)
    assert lineage_rows.turn_rows("agents", redis_client).num_rows == 1  # now from the shard alone


def test_turns_whose_workers_store_routed_experts_at_different_widths_share_one_shard(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    narrow = _turn(redis_client, tmp_path, "s-1-00002-abcdef", session="s-1", num_experts=8)  # uint8 ids
    wide = _turn(redis_client, tmp_path, "s-2-00002-abcdef", session="s-2")  # expert count unknown: uint16
    assert narrow[2].schema != wide[2].schema
    for job, requests, table in (narrow, wide):
        assert commit_turns(job, requests, table, redis_client)["logged"] == 1
    shard = flush_turns(redis_client, "agents", force=True)
    assert shard is not None
    [path] = list(Path(tmp_path, "shards").rglob("*.parquet"))
    written = pq.read_table(path)
    assert written.num_rows == 2 and sorted(written.column("session_id").to_pylist()) == ["s-1", "s-2"]
    assert written.schema.field("routed_experts").type == pa.list_(pa.uint16())
