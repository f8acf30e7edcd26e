"""The fast submit paths: the numpy prompt-id parse agrees with pydantic or steps aside, and prompt
ids travel beside their job in Redis (same transaction, validated by the worker, kept for retries,
expiring)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError, RequestFileError
from pipeline.core.jobs.queue import PROMPTS_TTL_S
from pipeline.submit.enqueue import submit_blocks, submit_file, submit_requests
from pipeline.submit.prompt_staging import STAGED_TTL_S
from pipeline.submit.request_file import (
    _fast_parse,
    parse_lines,
    parse_request_lines,
    read_request_lines,
    validation_errors,
)
from schemas.request import RolloutRequest
from tests.helpers.processes import wait_until
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker


@pytest.mark.parametrize("ids", ["1,2,3", " 1 , 2 ", "0", "2147483647", "150000, 7"])
def test_fast_parse_agrees_with_the_model(ids: str) -> None:
    line = f'{{"id": "a", "input_ids": [{ids}], "sampling_params": {{"n": 2, "stop": [3]}}, "metadata": {{"k": 1}}}}'
    assert _fast_parse(line.encode()).to_request() == RolloutRequest.model_validate_json(line)


@pytest.mark.parametrize("ids", ["", "1 2", "01", "1,,2", ",1", "1,", "1.0", "1e3", "-1", "true", "null",
                                 "2147483648", "99999999999999999999999", "[1]", '"1"', "1, [2]", "[1], [2]",
                                 "1, {}", "-0.0", "+1"])
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
    [job] = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer).get_jobs()
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


SMALL_FIELDS = [
    {},
    {"sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "n": 4, "seed": 7}, "metadata": {"group": 3}},
    {"sampling_params": {"temperature": 1, "seed": None}},
    {"sampling_params": {"n": 1}, "logprobs": None, "prompt_logprobs": 0, "return_routed_experts": True},
    {"sampling_params": {"stop": ["\n\n", "x"], "stop_token_ids": [9]}, "logprobs": 5},
    {"sampling_params": {"stop": [70], "seed": 0}, "metadata": {"nested": {"a": [1, 2.5, None, True]}}},
    {"prompt_text": "Question:\n\"hi\"", "metadata": {"caf\u00e9": "\u00e9t\u00e9"}},
    {"sampling_params": {"top_p": 0.5, "top_k": 20, "min_p": 0.1, "ignore_eos": True, "repetition_penalty": 1.1}},
]


@pytest.mark.parametrize("fields", SMALL_FIELDS)
@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_fast_lines_carry_what_the_model_would(fields: dict, ensure_ascii: bool) -> None:
    line = json.dumps({"id": "a", "input_ids": [5, 150000, 0], **fields}, ensure_ascii=ensure_ascii)
    model = RolloutRequest.model_validate_json(line)
    [parsed] = parse_request_lines([line.encode()])
    assert parsed.to_request() == model
    assert parsed.job_fields == model.model_dump(exclude={"input_ids"}, exclude_defaults=True)
    assert parsed.prompt_ids.tolist() == model.input_ids == parsed.input_ids
    assert parsed.sampling_params == model.sampling_params and parsed.n == model.sampling_params.n
    assert parsed.max_token_id() == model.max_token_id()
    assert (parsed.logprobs, parsed.return_routed_experts) == (model.logprobs, model.return_routed_experts)


@pytest.mark.parametrize("line", [
    b'\xef\xbb\xbf{"id": "a", "input_ids": [1]}',  # BOM
    b'{"id": "a", "input_ids": [1], "sampling_params": {"temperature": NaN}}',
    b'{"id": "a", "input_ids": [1], "sampling_params": {"temperature": Infinity}}',
    b'{"id": "a", "input_ids": [1], "metadata": {"k": NaN}}',
    b'{"id": "a", "input_ids": [1], "metadata": {"k": 1e400}}',
    b'{"id": "\\ud800", "input_ids": [1]}',  # lone surrogate
    b'{"id": "a", "input_ids": [1], "input_\\u0069ds": [2]}',  # the key again, escaped
    b'{"id": "a", "input_ids": [1], "sampling_params": {"seed": true}}',
    b'{"id": "a", "input_ids": [1], "sampling_params": {"seed": -1}}',
    b'{"id": "a", "input_ids": [1], "sampling_params": {"n": true}}',
    b'{"id": "a", "input_ids": [1], "logprobs": false}',
    b'{"id": "", "input_ids": [1]}',
    b'{"id": "a", "input_ids": [1], "metadata": []}',
    b'{"id": "a", "input_ids": [1], "metadata": {"k": "\xed\xa0\x80"}}',  # surrogate bytes: not UTF-8
    b'{"id": "a", "input_ids": [1]} x',
    b'["id", "input_ids": [1]]',
    b'{"id": "a", "input_ids": [1\t, +2]}',
    b'{"id": "a", "input_ids": [1], "id": "b"}',  # a duplicate key
    b'{"id": "a", "input_ids": [1], "input_ids": [2]}',
    b'{"id": "a", "metadata": {"x\\"input_ids": [3]}, "input_ids": [1, [2]]}',  # a look-alike key first
    b'{"id": "a", "input_ids": [1, [2]], "metadata": {"input_ids": [3]}}',
    b'{"id": "a", "input_ids": [1], "metadata": ' + b'{"k": ' * 300 + b'1' + b'}' * 301,  # deep nesting
    b'{"id": "a", "input_ids": [1], "metadata": {"k": "' + b'x' * (70 * 1024) + b'"}}',  # over the metadata limit
    b'{"id": "a", "input_ids": [1], "routing_key": "session-7"}',  # kept, checked by the model
    b'{"id": "a", "input_ids": [1], "routing_key": "two words"}',
])
def test_lines_the_fast_path_cannot_vouch_for_step_aside(line: bytes) -> None:
    assert _fast_parse(line) is None
    try:
        expected = RolloutRequest.model_validate_json(line)
    except ValidationError as exc:
        with pytest.raises(RequestFileError) as caught:
            parse_lines([line], path="f.jsonl")
        assert caught.value.errors == validation_errors("f.jsonl", 1, exc)
    else:
        assert parse_lines([line]) == [expected]


def test_validated_shapes_are_reused_only_for_identical_values() -> None:
    # true == 1 and 1.0 == 1 in Python: the cache must still tell them apart.
    lines = [json.dumps({"id": f"a{i}", "input_ids": [1], "sampling_params": {"n": n, "seed": i}})
             for i, n in enumerate([1, True, 1.0, 1])]
    with pytest.raises(RequestFileError) as caught:
        parse_lines(lines, path="f.jsonl")
    assert {(e.line, e.field) for e in caught.value.errors} == {(2, "sampling_params.n"), (3, "sampling_params.n")}


def test_one_bad_id_list_in_a_block_is_located() -> None:
    lines = [json.dumps({"id": f"a{i}", "input_ids": [i + 1, 20, 300]}) for i in range(300)]
    lines[137] = '{"id": "bad", "input_ids": [1, 020, 3]}'  # leading zero: numpy reads 20
    lines[250] = '{"id": "big", "input_ids": [1, 2147483648]}'
    with pytest.raises(RequestFileError) as caught:
        parse_lines(lines, path="f.jsonl")
    assert [(e.line, e.field) for e in caught.value.errors] == [(138, ""), (251, "input_ids[1]")]
    assert "not valid JSON" in caught.value.errors[0].message


def test_a_malformed_line_is_named_by_its_file_line_and_a_column_within_it() -> None:
    """The JSON parser counts lines within the one line it is given (a cut-off line ends on its "line 2"):
    the message names the file's line and a column of that line, never the parser's own line count."""
    lines = [json.dumps({"id": f"a{i}", "input_ids": [1, 2]}) for i in range(3)]
    with pytest.raises(RequestFileError) as caught:
        parse_lines([*lines, '{"id": "d", "input_ids": [1, 2\n', '{"id": }'], path="f.jsonl")
    (cut, broken) = caught.value.errors
    assert cut.line == 4 and cut.message.endswith("at the end of the line)") and "line 2" not in cut.message
    assert broken.line == 5 and broken.message.endswith("at column 8)")


def test_parsed_lines_submit_the_same_jobs_as_models(redis_client: redis.Redis, tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"r{i}", "input_ids": [i, 70000 if i == 3 else 7],
                         "sampling_params": {"n": 1 + i % 2, "seed": i}, "metadata": {"i": i}})
             for i in range(5)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    parsed = read_request_lines(path)
    models = [r.to_request() for r in parsed]
    plans = [submit_requests(redis_client, requests, run=f"same{k}", output="memory://x", batch_size=2)
             for k, requests in enumerate([parsed, models])]
    assert plans[0].samples == plans[1].samples == 7
    queue = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    jobs = {job.id: job for job in queue.get_jobs()}
    for ours, theirs in zip(plans[0].job_ids, plans[1].job_ids, strict=True):
        a, b = jobs[ours].args[0], jobs[theirs].args[0]
        same = ("requests", "prompt_lengths", "prompt_dtype", "prompt_tokens", "schema_version")
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        assert redis_client.get(a["prompt_key"]) == redis_client.get(b["prompt_key"])


def _keyspace(conn: redis.Redis) -> set[bytes]:
    return set(conn.keys("*"))


def test_a_bad_line_after_staged_jobs_leaves_redis_as_it_was(redis_client: redis.Redis, tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"r{i}", "input_ids": [i + 1, 7]}) for i in range(300)]
    lines.append('{"id": "last", "input_ids": [1], "bogus": 1}')
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    before = _keyspace(redis_client)
    with pytest.raises(RequestFileError) as caught:
        submit_file(redis_client, path, run="late", output="memory://x", batch_size=8)
    assert [(e.line, e.field) for e in caught.value.errors] == [(301, "bogus")]
    # Jobs of the first 256 lines had their prompt ids staged; all of it is gone again.
    assert _keyspace(redis_client) == before
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0


def test_staged_prompt_ids_that_vanish_fail_the_submit_and_enqueue_nothing(redis_client: redis.Redis) -> None:
    def blocks() -> Iterator[list[RolloutRequest]]:
        yield [RolloutRequest(id=f"a{i}", input_ids=[1, 2]) for i in range(4)]
        staged = f"{keys.PREFIX}:prompts:*"
        wait_until(lambda: any(redis_client.scan_iter(staged)), what="the first job's ids staged")
        for key in redis_client.scan_iter(staged):
            redis_client.delete(key)  # evicted (or flushed) before the jobs are enqueued
        yield [RolloutRequest(id="b", input_ids=[3])]

    before = _keyspace(redis_client)
    with pytest.raises(PipelineError, match="staged prompt-id keys vanished"):
        submit_blocks(redis_client, blocks(), run="gone", output="memory://x", batch_size=4)
    assert _keyspace(redis_client) == before
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0


def test_submit_file_enqueues_what_read_and_submit_would(redis_client: redis.Redis, tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"r{i}", "input_ids": list(range(i + 1, i + 9)), "sampling_params": {"n": 2}})
             for i in range(70)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    streamed = submit_file(redis_client, path, run="streamed", output="memory://x", batch_size=32)
    listed = submit_requests(redis_client, read_request_lines(path), run="listed", output="memory://x", batch_size=32)
    assert (streamed.requests, streamed.samples, len(streamed.job_ids)) == (70, 140, 3)
    assert (listed.requests, listed.samples, len(listed.job_ids)) == (70, 140, 3)
    queue = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    jobs = {job.id: job.args[0] for job in queue.get_jobs()}
    for ours, theirs in zip(streamed.job_ids, listed.job_ids, strict=True):
        assert jobs[ours]["requests"] == jobs[theirs]["requests"]
        assert redis_client.get(jobs[ours]["prompt_key"]) == redis_client.get(jobs[theirs]["prompt_key"])
        assert STAGED_TTL_S < redis_client.ttl(jobs[ours]["prompt_key"]) <= PROMPTS_TTL_S
