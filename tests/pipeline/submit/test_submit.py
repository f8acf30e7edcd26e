"""`pipeline submit`: every line validated first, all-or-nothing enqueue, JSON jobs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import keys
from tests.conftest import PIPELINE
from tests.helpers.refusing_redis import allow_writes, refuse_writes

GOOD = {"id": "q0", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def good_lines(count: int) -> list[str]:
    return [json.dumps({**GOOD, "id": f"q{i}"}) for i in range(count)]


BAD_FILES = {
    "not_json": (["{oops"], 1, "not valid JSON"),
    "missing_id": ([json.dumps({"input_ids": [1]})], 1, "id: required field is missing"),
    "missing_input_ids": ([json.dumps({"id": "x"})], 1, "input_ids: required field is missing"),
    "duplicate_id": ([json.dumps(GOOD), json.dumps(GOOD)], 2, "duplicate id 'q0'"),
    "string_for_number": (
        [json.dumps({**GOOD, "sampling_params": {"max_new_tokens": "4"}})], 1,
        "sampling_params.max_new_tokens: Input should be a valid integer",
    ),
    "unknown_field": ([json.dumps({**GOOD, "temprature": 0.5})], 1,
                      "temprature: unknown field; did you mean 'temperature' inside \"sampling_params\"?"),
    "chat_without_tokenizer": ([json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}]})], 1,
                               "messages: a chat line needs a tokenizer to render it into input_ids: pass "
                               "--tokenizer PATH"),
    "negative_token": ([json.dumps({**GOOD, "input_ids": [1, -5]})], 1, "input_ids[1]: Input should be greater"),
    "huge_token": ([json.dumps({**GOOD, "input_ids": [2**40]})], 1, "input_ids[0]: Input should be less"),
    "scalar_stop": (
        [json.dumps({**GOOD, "sampling_params": {"stop": 576}})], 1, "sampling_params.stop: stop: 576 is a bare number"
    ),
    "empty_file": ([], 1, "file holds no requests"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_refused_with_its_line_and_nothing_is_enqueued(
    case: str, tmp_path: Path, pipeline_env: dict[str, str], redis_client: redis.Redis
) -> None:
    lines, line_number, message = BAD_FILES[case]
    # Valid lines before the bad one must not be enqueued either.
    path = write_lines(tmp_path / "rollouts.jsonl", [*good_lines(3)[1:], *lines] if case != "empty_file" else [])
    offset = 2 if case != "empty_file" else 0
    result = subprocess.run([*PIPELINE, "submit", str(path)], env=pipeline_env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert f"{path}:{line_number + offset}: " in result.stderr if case != "empty_file" else str(path) in result.stderr
    assert message in result.stderr
    assert "nothing was enqueued" in result.stderr
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0
    assert redis_client.keys("rq:job:*") == []


def test_submit_enqueues_json_jobs_in_batches(
    tmp_path: Path, pipeline_env: dict[str, str], redis_client: redis.Redis
) -> None:
    path = write_lines(tmp_path / "rollouts.jsonl", good_lines(10))
    result = subprocess.run(
        [*PIPELINE, "submit", str(path), "--run", "step-1", "--batch-size", "4", "--output", "memory://out"],
        env=pipeline_env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "run: step-1" in result.stdout
    assert "requests: 10 (10 samples) in 3 jobs" in result.stdout
    assert "output: memory://out/step-1" in result.stdout
    queue = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    jobs = queue.get_jobs()
    assert [len(job.args[0]["requests"]) for job in jobs] == [4, 4, 2]
    assert all(job.func_name == "workers.jobs.batch_job.run_rollout_batch" for job in jobs)
    # JSON on the wire, never pickle: the stored data decodes as JSON after RQ's zlib.
    import zlib

    raw = redis_client.hget(jobs[0].key, "data")
    decoded = json.loads(zlib.decompress(raw))
    assert decoded[0] == "workers.jobs.batch_job.run_rollout_batch"
    assert isinstance(decoded[2][0]["prompt_tokens"], str)


def test_python_api_accepts_dicts_and_rejects_bad_ones(redis_url: str, redis_client: redis.Redis) -> None:
    client = pipeline.connect(redis_url)
    batch = client.submit([{**GOOD, "id": "a"}, {**GOOD, "id": "b"}], run="api", output="memory://x")
    assert len(batch.job_ids) == 1 and batch.url == "memory://x/api"
    with pytest.raises(pipeline.RequestFileError, match="unknown field"):
        client.submit([{**GOOD, "id": "c"}, {**GOOD, "id": "d", "bogus": 1}], run="api2")
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 1


def test_capabilities_checked_against_live_workers(redis_url: str, redis_client: redis.Redis) -> None:
    import time

    from pipeline.core.broker import registry
    from schemas.worker_info import Capabilities, WorkerInfo

    registry.publish(redis_client, WorkerInfo(
        worker_id="w1", host="h", pid=1, engine="hf", model="m", started_at=time.time(), heartbeat_at=0,
        capabilities=Capabilities(max_top_logprobs=0, vocab_size=100),
    ))
    client = pipeline.connect(redis_url)
    with pytest.raises(pipeline.CapabilityError, match="top-5 logprobs"):
        client.submit([{**GOOD, "logprobs": 5}])
    with pytest.raises(pipeline.CapabilityError, match="pool 'default' has token id 100 in its vocabulary"):
        client.submit([{**GOOD, "input_ids": [100]}])
    with pytest.raises(pipeline.CapabilityError, match=r"has routed experts \(routed experts need a mixture"):
        client.submit([{**GOOD, "return_routed_experts": True}])
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0


def test_logprobs_a_vllm_worker_cannot_give_exactly_fail_at_submit(redis_url: str, redis_client: redis.Redis) -> None:
    import time

    from pipeline.core.broker import registry
    from schemas.worker_info import Capabilities, WorkerInfo
    from workers.engines.vllm.mapping import logprob_capabilities

    registry.publish(redis_client, WorkerInfo(
        worker_id="w1", host="h", pid=1, engine="vllm-http", model="m", started_at=time.time(), heartbeat_at=0,
        capabilities=Capabilities(**logprob_capabilities("raw_logprobs")),
    ))
    client = pipeline.connect(redis_url)
    hot = {**GOOD, "sampling_params": {"max_new_tokens": 4, "temperature": 0.7}}
    with pytest.raises(pipeline.CapabilityError, match=r"logprobs at a temperature other than 0 or 1 \(a vLLM server "
                                                       r"gives them with --logprobs-mode processed_logprobs"):
        client.submit([hot])
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0
    client.submit([{**hot, "logprobs": None}, {**GOOD, "id": "greedy",
                                               "sampling_params": {"max_new_tokens": 4, "temperature": 0}}])
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 1


def test_a_missing_file_or_an_unreachable_redis_is_a_clear_error(tmp_path: Path, pipeline_env: dict[str, str]) -> None:
    missing = subprocess.run([*PIPELINE, "submit", str(tmp_path / "nope.jsonl")], env=pipeline_env,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and f"error: no such file: {tmp_path / 'nope.jsonl'}; give the path of a JSONL" \
        in missing.stderr
    path = write_lines(tmp_path / "rollouts.jsonl", good_lines(2))
    down = subprocess.run([*PIPELINE, "submit", str(path), "--redis", "redis://127.0.0.1:9"],
                          env={**pipeline_env, "PIPELINE_REDIS_RECONNECT_S": "1"}, capture_output=True, text=True)
    assert down.returncode == 4 and "cannot reach Redis" in down.stderr and "nothing was done" in down.stderr
    assert "Traceback" not in missing.stderr + down.stderr


def test_vocab_size_flag_refuses_ids_outside_the_vocabulary(
    tmp_path: Path, pipeline_env: dict[str, str], redis_client: redis.Redis
) -> None:
    big = json.dumps({**GOOD, "id": "big", "input_ids": [1, 9]})
    path = write_lines(tmp_path / "rollouts.jsonl", [*good_lines(70), big])
    result = subprocess.run([*PIPELINE, "submit", str(path), "--vocab-size", "4", "--batch-size", "8"],
                            env=pipeline_env, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert f"{path}:71: input_ids: token id 9 is outside the model's vocabulary of 4" in result.stderr
    assert Queue(keys.pool().queue_name, connection=redis_client).count == 0
    assert redis_client.keys(f"{keys.PREFIX}:prompts:*") == []  # 8 jobs' ids were staged, then deleted


def test_max_staleness_travels_in_every_job_and_a_negative_one_is_refused(
    tmp_path: Path, pipeline_env: dict[str, str], redis_client: redis.Redis
) -> None:
    path = write_lines(tmp_path / "rollouts.jsonl", good_lines(3))
    refused = subprocess.run([*PIPELINE, "submit", str(path), "--max-staleness", "-1"], env=pipeline_env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "--max-staleness must be 0 or more weight versions, not -1" in refused.stderr
    assert redis_client.keys("rq:job:*") == []
    result = subprocess.run([*PIPELINE, "submit", str(path), "--max-staleness", "2", "--batch-size", "2",
                             "--output", "memory://out"], env=pipeline_env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    jobs = Queue(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer).get_jobs()
    assert [job.args[0]["max_staleness"] for job in jobs] == [2, 2]


def test_a_redis_refusing_writes_past_the_reconnect_time_is_a_clear_error(
        tmp_path: Path, pipeline_env: dict[str, str], redis_client: redis.Redis) -> None:
    path = write_lines(tmp_path / "rollouts.jsonl", good_lines(2))
    refuse_writes(redis_client)
    try:
        refused = subprocess.run([*PIPELINE, "submit", str(path)], capture_output=True, text=True,
                                 env={**pipeline_env, "PIPELINE_REDIS_RECONNECT_S": "1"})
    finally:
        allow_writes(redis_client)
    assert refused.returncode == 4 and "Traceback" not in refused.stderr, refused.stderr
    assert "Redis refused the command" in refused.stderr and "NOREPLICAS" in refused.stderr
