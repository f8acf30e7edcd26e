"""The fast submit paths: the numpy prompt-id parse agrees with pydantic or steps aside, and prompt
ids travel beside their job in Redis (same transaction, validated by the worker, kept for retries,
expiring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline import keys
from pipeline.errors import RequestFileError
from pipeline.request_file import _fast_parse, parse_lines
from pipeline.submit import PROMPTS_TTL_S
from schemas.request import RolloutRequest
from tests.fakes import FakeEngine
from workers.worker import RolloutWorker


@pytest.mark.parametrize("ids", ["1,2,3", " 1 , 2 ", "0", "2147483647", "150000, 7"])
def test_fast_parse_agrees_with_the_model(ids: str) -> None:
    line = f'{{"id": "a", "input_ids": [{ids}], "sampling_params": {{"n": 2, "stop": [3]}}, "metadata": {{"k": 1}}}}'
    assert _fast_parse(line.encode()) == RolloutRequest.model_validate_json(line)


@pytest.mark.parametrize("ids", ["", "1 2", "01", "1,,2", ",1", "1,", "1.0", "1e3", "-1", "true", "null",
                                 "2147483648", "99999999999999999999999", "[1]", '"1"'])
def test_unusual_ids_step_aside_and_pydantic_words_the_error(ids: str) -> None:
    line = f'{{"id": "a", "input_ids": [{ids}]}}'
    assert _fast_parse(line.encode()) is None
    with pytest.raises(RequestFileError) as caught:
        parse_lines([line], path="f.jsonl")
    assert all(e.line == 1 and (e.field.startswith("input_ids") or e.field == "") for e in caught.value.errors)


def test_other_fields_keep_their_located_errors() -> None:
    lines = ['{"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1.5}}',
             '{"id": "b", "input_ids": [1], "bogus": 1}',
             '{"id": "c", "input_ids": [1], "metadata": {"input_ids": [1.5]}}']
    with pytest.raises(RequestFileError) as caught:
        parse_lines(lines, path="f.jsonl")
    found = {(e.line, e.field) for e in caught.value.errors}
    assert found == {(1, "sampling_params.max_new_tokens"), (2, "bogus")}


def test_prompt_ids_travel_beside_the_job(redis_client: redis.Redis, tmp_path: Path) -> None:
    requests = [{"id": f"r{i}", "input_ids": [i + 1] * 5} for i in range(3)]
    batch = pipeline.Client(redis_client).submit(requests, run="beside", output=f"file://{tmp_path}")
    [job_id] = batch.job_ids
    key = keys.prompts(job_id)
    assert len(redis_client.get(key)) == 15 * 2  # uint16: every id fits
    assert 0 < redis_client.ttl(key) <= PROMPTS_TTL_S
    [job] = Queue(keys.QUEUE_NAME, connection=redis_client, serializer=JSONSerializer).get_jobs()
    payload = job.args[0]
    assert payload["prompt_key"] == key and payload["prompt_tokens"] == "" and "input_ids" not in json.dumps(payload)
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="WARNING")
    assert batch.wait(timeout=5).counts["finished"] == 1
    assert sorted(map(tuple, batch.read().column("prompt_token_ids").to_pylist())) == [(i + 1,) * 5 for i in range(3)]
    assert 0 < redis_client.ttl(key) <= 3600  # done: kept briefly, then gone


def test_missing_or_tampered_prompt_ids_fail_the_job_and_retries_find_them(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    client = pipeline.Client(redis_client)
    gone = client.submit([{"id": "a", "input_ids": [1, 2]}], run="gone", output=f"file://{tmp_path}")
    redis_client.delete(keys.prompts(gone.job_ids[0]))
    short = client.submit([{"id": "b", "input_ids": [1, 2]}], run="short", output=f"file://{tmp_path}")
    redis_client.set(keys.prompts(short.job_ids[0]), b"\x01\x00")
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="WARNING")
    assert "gone from Redis" in gone.failures()[gone.job_ids[0]]
    assert "lengths say 2 ids" in short.failures()[short.job_ids[0]]
    # After failing (all retries spent) the ids are still there for a manual requeue.
    assert redis_client.exists(keys.prompts(short.job_ids[0]))
    assert not (tmp_path / "gone").exists()
