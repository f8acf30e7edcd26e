"""Placing a submit on the pool's live workers: a request no live worker can serve is named by its
id (and, for table rows, its row), whatever the input kind and batch size; nothing is enqueued."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

import pipeline
from pipeline.cli.main import main as cli_main
from pipeline.core.broker import keys, registry
from pipeline.core.jobs.queue import rollout_queue
from pipeline.submit.enqueue import submit_file
from schemas.capabilities import Needs
from schemas.worker_info import Capabilities, WorkerInfo

ROWS = {"id": ["a", "b", "c", "d"], "input_ids": [[1, 2, 3], [4, 5, 6], [7, 99999, 9], [10, 11]]}


@pytest.fixture
def live_worker(redis_client: redis.Redis) -> None:
    """A live worker of the default pool whose model has 1000 tokens."""
    registry.publish(redis_client, WorkerInfo(
        worker_id="w1", host="h", pid=1, engine="hf", model="m", started_at=time.time(), heartbeat_at=time.time(),
        capabilities=Capabilities(vocab_size=1000)), ttl_s=60)


def _nothing_enqueued(conn: redis.Redis) -> None:
    assert rollout_queue(conn).count == 0 and not conn.smembers(keys.pool(None).runs)


@pytest.mark.parametrize("batch_size", [64, 1])
def test_a_table_names_the_row_whose_token_is_outside_the_vocabulary(
        batch_size: int, redis_url: str, redis_client: redis.Redis, live_worker: None) -> None:
    client = pipeline.connect(redis_url)
    with pytest.raises(pipeline.CapabilityError) as refused:
        client.submit(pa.table(ROWS), output="memory://x", batch_size=batch_size)
    message = str(refused.value)
    assert "request 'c' (row 2):" in message and "token id 99999" in message, message
    assert "'a'" not in message
    _nothing_enqueued(redis_client)


@pytest.mark.parametrize("batch_size", ["64", "1"])
def test_a_parquet_submit_names_the_row_whose_token_is_outside_the_vocabulary(
        batch_size: str, redis_url: str, redis_client: redis.Redis, live_worker: None, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(pa.table({"input_ids": ROWS["input_ids"]}), tmp_path / "d.parquet")
    code = cli_main(["submit", str(tmp_path / "d.parquet"), "--redis", redis_url, "--output", "memory://x",
                     "--batch-size", batch_size])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "request '2' (row 2):" in err and "token id 99999" in err, err
    _nothing_enqueued(redis_client)


def test_request_dicts_name_the_request(redis_url: str, redis_client: redis.Redis, live_worker: None) -> None:
    rows = [{"id": i, "input_ids": ids} for i, ids in zip(ROWS["id"], ROWS["input_ids"], strict=True)]
    with pytest.raises(pipeline.CapabilityError, match=r"request 'c': .*token id 99999"):
        pipeline.connect(redis_url).submit(rows, output="memory://x")
    _nothing_enqueued(redis_client)


def test_lines_of_one_shape_are_packed_by_the_vocabularies_their_ids_fit(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    for worker_id, vocab in (("small", 100), ("large", 1000)):
        registry.publish(redis_client, WorkerInfo(
            worker_id=worker_id, host="h", pid=1, engine="hf", model="m", started_at=time.time(),
            heartbeat_at=time.time(), capabilities=Capabilities(vocab_size=vocab)), ttl_s=60)
    ids = [[1, 2], [500], [3], [99, 700], [4, 5], [6], [120]]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": prompt, "logprobs": 0,
                                        "sampling_params": {"temperature": 1.0, "seed": i}}) + "\n"
                            for i, prompt in enumerate(ids)))
    plan = submit_file(redis_client, path, output="memory://x", batch_size=2)
    jobs = rollout_queue(redis_client).get_jobs()
    packed = [[request["id"] for request in job.args[0]["requests"]] for job in jobs]
    assert sorted(packed) == [["r0", "r2"], ["r1", "r3"], ["r4", "r5"], ["r6"]] and len(plan.job_ids) == 4
    largest = {f"r{i}": max(prompt) for i, prompt in enumerate(ids)}
    for job, members in zip(jobs, packed, strict=True):
        assert Needs.from_dict(job.meta["needs"]) == Needs(max_token_id=max(largest[m] for m in members))


def test_a_jobs_meta_carries_only_the_needs_that_differ_from_the_defaults(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"id": "plain", "input_ids": [1, 2]},
        {"id": "top2", "input_ids": [3], "logprobs": 2, "sampling_params": {"temperature": 0.5}},
    )))
    submit_file(redis_client, path, output="memory://x")
    metas = {job.args[0]["requests"][0]["id"]: job.meta["needs"] for job in rollout_queue(redis_client).get_jobs()}
    # The largest token id always: the worker's admission checks it against its vocabulary (no worker
    # was live to check it at submit).
    assert metas == {"plain": {"max_token_id": 2}, "top2": {"top_logprobs": 2, "max_token_id": 3,
                                                            "tempered_logprobs": True}}
    assert Needs.from_dict(metas["top2"]) == Needs(top_logprobs=2, max_token_id=3, tempered_logprobs=True)
