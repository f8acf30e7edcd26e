"""A job's adapters on in-process workers: the sim serves them (each adapter version its own draws,
the least recently used evicted past --max-adapters and read again from the store); an engine that
serves no adapters refuses the job, which fails with the reason and never runs on the base."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.errors import JobsFailedError
from schemas.request import RolloutRequest
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import burst_worker
from workers.engines.fake import FakeEngine
from workers.engines.sim.engine import SimConfig, SimEngine, simulate_sample


def _request(ident: str, adapter: str | None) -> dict[str, object]:
    return {"id": ident, "input_ids": [1, 2, 3], "adapter": adapter,
            "sampling_params": {"max_new_tokens": 8, "seed": 7}}


@pytest.fixture
def client(redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pipeline.Client:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    return pipeline.Client(redis_client)


def test_the_sim_draws_each_adapter_version_its_own_tokens_and_evicts_past_its_capacity(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    for name, seed in (("a", 1), ("b", 2)):
        client.push_adapter(name, build_adapter(tiny_model_dir, tmp_path / name, seed=seed), base=tiny_model_dir)
    config = SimConfig(max_adapters=1, median_tokens=8, p99_tokens=9)
    engine = SimEngine(config)
    output = f"file://{tmp_path}/out"
    first = client.submit([_request("x", None), _request("y", "a")], run="one", output=output)
    burst_worker(redis_client, engine)
    second = client.submit([_request("x", "b")], run="two", output=output)
    burst_worker(redis_client, engine)
    client.push_adapter("a", build_adapter(tiny_model_dir, tmp_path / "a2", seed=3), base=tiny_model_dir)
    third = client.submit([_request("x", "a"), _request("y", "a")], run="three", output=output)
    burst_worker(redis_client, engine, close=True)
    rows = {run: b.read().sort_by("request_id").to_pylist() for run, b in
            (("one", first), ("two", second), ("three", third))}
    assert [(r["adapter"], r["adapter_version"]) for r in rows["one"] + rows["two"] + rows["three"]] == [
        (None, None), ("a", 1), ("b", 1), ("a", 2), ("a", 2)]
    base = simulate_sample(config, RolloutRequest.model_validate(_request("x", None)), 0, 0)
    assert rows["one"][0]["completion_token_ids"] == base.token_ids.tolist()
    x = [tuple(rows[run][0]["completion_token_ids"]) for run in ("one", "two", "three")]
    assert len(set(x)) == 3  # request x on the base, on b v1 and on a v2
    assert rows["one"][1]["completion_token_ids"] != rows["three"][1]["completion_token_ids"]  # y on a v1, a v2
    assert (engine.adapters.loads, engine.adapters.evictions, list(engine.adapters.resident)) == (3, 2, ["a@v2"])


def test_an_engine_without_adapters_refuses_the_job_which_fails_with_the_reason(
        client: pipeline.Client, redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")
    client.push_adapter("a", build_adapter(tiny_model_dir, tmp_path / "a", seed=1), base=tiny_model_dir)
    batch = client.submit([_request("x", "a")], run="r", output=f"file://{tmp_path}/out")
    engine = FakeEngine()
    burst_worker(redis_client, engine)
    burst_worker(redis_client, engine)  # the job again: refused by this worker before, no other can serve it
    with pytest.raises(JobsFailedError) as failed:
        batch.wait(timeout=30)
    [reason] = failed.value.failures.values()
    assert "names adapter 'a'; the fake engine serves no LoRA adapters" in reason
    assert engine.calls == [] and batch.status().counts["finished"] == 0
