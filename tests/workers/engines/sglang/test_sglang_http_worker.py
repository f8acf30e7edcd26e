"""A real worker over the sglang-http engine and a stand-in server: rows, and no partial shard."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.errors import JobsFailedError
from tests.helpers.models import token_id
from tests.helpers.processes import drive_worker, wait_until
from tests.workers.engines.conftest import Standin
from workers.engines.async_bridge import AsyncBridge
from workers.engines.sglang.http_engine import SGLangHTTPEngine
from workers.process.worker import RolloutWorker


def lines() -> list[dict]:
    a, b, c, d = (token_id(x) for x in "abcd")
    return [
        {"id": "eos", "input_ids": [a, b], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        {"id": "tok", "input_ids": [a, b], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": [d]}},
        {"id": "str", "input_ids": [a, b], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": "d"}},
        {"id": "n2", "input_ids": [c], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "n": 2},
         "metadata": {"group": "g"}},
    ]


def test_worker_writes_rows_from_the_standin(
    scripted_server: Standin, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    batch = pipeline.connect(redis_url).submit(lines(), run="http", output=f"file://{tmp_path}", batch_size=2)
    run_worker(scripted_server, redis_client)
    batch.wait(timeout=10)
    rows = {r["rollout_id"]: r for r in batch.read().to_pylist()}
    assert sorted(rows) == ["eos:0", "n2:0", "n2:1", "str:0", "tok:0"]
    assert {r["engine"] for r in rows.values()} == {"sglang-http"}
    assert rows["tok:0"]["stop_reason_token"] == token_id("d") and rows["tok:0"]["finish_reason"] == "stop"
    assert rows["str:0"]["stop_reason_text"] == "d" and rows["str:0"]["completion_text"] == "c"
    assert rows["eos:0"]["stop_reason_token"] is None and rows["eos:0"]["completion_token_ids"][-1] == 0
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in rows.values())
    assert rows["n2:1"]["metadata"] == '{"group":"g"}'


def run_worker(server: Standin, redis_client: redis.Redis) -> None:
    engine = SGLangHTTPEngine([server.url])
    try:
        RolloutWorker(redis_client, engine).work(burst=True, with_scheduler=False, logging_level="CRITICAL")
    finally:
        engine.close()


def shard_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_a_malformed_answer_fails_the_attempt_and_the_retry_writes_the_shard(
    scripted_server: Standin, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    scripted_server.faults(truncated=1)
    batch = pipeline.connect(redis_url).submit(lines()[:2], run="once", output=f"file://{tmp_path}")
    run_worker(scripted_server, redis_client)
    batch.wait(timeout=10)
    assert scripted_server.stats()["faults"][-1] == "truncated"
    assert len(shard_files(tmp_path)) == 1 and batch.read().num_rows == 2


def test_malformed_answers_fail_the_job_and_write_no_shard(
    scripted_server: Standin, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    scripted_server.faults(truncated=100)
    batch = pipeline.connect(redis_url).submit(lines()[:2], run="bad", output=f"file://{tmp_path}")
    run_worker(scripted_server, redis_client)
    with pytest.raises(JobsFailedError, match="not JSON"):
        batch.wait(timeout=10)
    assert shard_files(tmp_path) == []
    assert batch.committed_rows() == 0


class JobTimeout(Exception):
    """Stands for RQ's job-timeout exception, raised from a SIGALRM handler."""


def test_bridge_cancels_the_coroutine_when_the_caller_is_interrupted() -> None:
    bridge = AsyncBridge(cleanup_timeout_s=2)
    cleaned = threading.Event()

    async def long_batch() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cleaned.set()  # where the adapters send /abort_request
            raise

    def timeout(signum: int, frame: object) -> None:
        raise JobTimeout

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(JobTimeout):
            bridge.run(long_batch())
        assert cleaned.is_set()
        assert bridge.run(asyncio.sleep(0, result=7)) == 7   # the loop still serves
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        bridge.close()


def test_a_canceled_job_in_flight_is_aborted_on_the_server_by_rid(
    scripted_server: Standin, redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    scripted_server.faults(delay_s=60)  # each generation waits a minute unless aborted
    before = scripted_server.stats()
    client = pipeline.connect(redis_url)
    batch = client.submit(lines()[:2], run="cancel-http", output=f"file://{tmp_path}", batch_size=2)

    def driver() -> None:
        wait_until(lambda: scripted_server.stats()["http_generate"] >= before["http_generate"] + 2, timeout=30,
                   what="both requests on the server")
        client.cancel("cancel-http")
        assert batch.wait(timeout=30).canceled == 1

    drive_worker(redis_client, SGLangHTTPEngine([scripted_server.url]), driver)
    after = scripted_server.stats()
    aborted = after["abort_requests"][len(before["abort_requests"]):]
    assert len(aborted) == 2 and all(set(a) == {"rid"} for a in aborted)  # one abort per request, by rid
    assert after["answered_aborted"] - before["answered_aborted"] == 2
    assert shard_files(tmp_path) == []
    with pytest.raises(pipeline.core.errors.NoShardsError):
        pipeline.read_rollouts(f"file://{tmp_path}", "cancel-http")
