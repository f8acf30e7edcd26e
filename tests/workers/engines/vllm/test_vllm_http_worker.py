"""A real worker (real Redis) around the vllm-http engine, its server replaying a real vLLM 0.32
server's recorded answers (tests/fixtures/vllm): rows through the whole loop, and a request the
server's logprobs mode cannot serve exactly refused, at submit once the worker is live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

import pipeline
from pipeline.core.broker import registry
from tests.workers.engines.fake_vllm import URL, FakeVLLM, fixture
from workers.engines.vllm.http_engine import VLLMHTTPEngine
from workers.process.worker import RolloutWorker

PROMPT = fixture("completion_eos")["request"]["body"]["prompt"]


def by_request(body: dict[str, Any]) -> httpx.Response:
    """The recorded completion whose request asked what `body` asks (stops, budget)."""
    if body["stop"]:
        name = "completion_stop_string"
    elif body["stop_token_ids"]:
        name = "completion_stop_token_id"
    elif body["max_tokens"] == 3:
        name = "completion_length"
    else:
        name = "completion_eos"
    return httpx.Response(200, json=fixture(name)["response"])


def line(rid: str, **sampling: Any) -> dict[str, Any]:
    return {"id": rid, "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, **sampling}}


def test_a_worker_writes_the_servers_answers_as_rows(redis_url: str, redis_client: redis.Redis,
                                                     tmp_path: Path) -> None:
    server = FakeVLLM(completions=[by_request] * 4)
    batch = pipeline.connect(redis_url).submit(
        [line("eos"), line("str", stop=[" Paris"]), line("tok", stop=[4649]), line("len", max_new_tokens=3)],
        run="vllm", output=f"file://{tmp_path}", batch_size=2)
    engine = VLLMHTTPEngine([URL], transport=server.transport())
    try:
        RolloutWorker(redis_client, engine).work(burst=True, with_scheduler=False, logging_level="CRITICAL")
    finally:
        engine.close()
    batch.wait(timeout=10)
    rows = {r["request_id"]: r for r in batch.read().to_pylist()}
    assert {r["engine"] for r in rows.values()} == {"vllm-http"}
    assert rows["eos"]["finish_reason"] == "stop" and rows["eos"]["stop_reason_token"] is None
    assert rows["eos"]["completion_token_ids"][-1] == 2
    assert rows["str"]["stop_reason_text"] == " Paris" and rows["str"]["completion_text"] == "The capital of France is"
    assert rows["tok"]["stop_reason_token"] == 4649 and rows["tok"]["completion_token_ids"][-1] == 4649
    assert rows["len"]["finish_reason"] == "length" and len(rows["len"]["completion_token_ids"]) == 3
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in rows.values())


def test_what_the_servers_logprobs_mode_cannot_serve_is_refused_at_submit(redis_url: str,
                                                                          redis_client: redis.Redis) -> None:
    server = FakeVLLM(logprobs_mode="raw_logprobs")
    engine = VLLMHTTPEngine([URL], transport=server.transport())
    try:
        worker = RolloutWorker(redis_client, engine)
        registry.publish(redis_client, worker.info)  # what a live worker's heartbeat publishes
        client = pipeline.connect(redis_url)
        with pytest.raises(pipeline.CapabilityError, match="logprobs at a temperature other than 0 or 1"):
            client.submit([line("hot", temperature=0.7)])
        client.submit([line("hot", temperature=0.7) | {"logprobs": None}])  # no logprobs: served
    finally:
        engine.close()
