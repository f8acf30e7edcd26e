"""A job naming an adapter on a `vllm-http` worker whose vLLM server was started without
`--enable-lora` (the recorded vLLM 0.32 server, `tests.workers.engines.fake_vllm`): refused with the
reason, the job failing with it once no worker can serve it; no completion is ever sent, so it is
never served by the base weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.errors import JobsFailedError
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import burst_worker
from tests.workers.engines.fake_vllm import URL, FakeVLLM
from workers.engines.vllm.http_engine import VLLMHTTPEngine


def test_a_server_without_lora_refuses_the_job_with_why_and_never_serves_it_on_the_base(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")
    client = pipeline.Client(redis_client)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql", seed=1), base=tiny_model_dir)
    batch = client.submit([{"id": "x", "input_ids": [1, 2, 3], "adapter": "sql",
                            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}],
                          run="r", output=f"file://{tmp_path}/out")
    server = FakeVLLM()
    engine = VLLMHTTPEngine([URL], transport=server.transport(), adapter_dir=tmp_path / "adapters")
    burst_worker(redis_client, engine)
    burst_worker(redis_client, engine, close=True)  # refused by this worker before, no other can serve it
    with pytest.raises(JobsFailedError) as failed:
        batch.wait(timeout=30)
    [reason] = failed.value.failures.values()
    assert "adapter sql@v1 does not load on this worker" in reason and "without --enable-lora" in reason
    assert not [p for p in server.paths() if p.startswith(("/v1/completions", "/v1/load_lora_adapter"))]
