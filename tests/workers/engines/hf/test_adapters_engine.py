"""The hf engine's adapters across a base weight push: a store version applied in place changes the
base tensors under the resident LoRA layers, each row then base v1 + its adapter as peft computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.weights.safetensors_io import read_checkpoint
from pipeline.core.weights.store import WeightStore
from pipeline.weights.writer import write_version
from schemas.request import RolloutRequest
from tests.helpers.adapters import build_adapter, greedy_reference
from workers.engines.hf.engine import HFEngine
from workers.jobs.adapters import pin_adapters


def test_a_store_push_applies_under_resident_adapters(redis_client: redis.Redis, tiny_model_dir: Path,
                                                      v1_model_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    adapter = build_adapter(tiny_model_dir, tmp_path / "sql", seed=1)
    pipeline.Client(redis_client).push_adapter("sql", adapter, base=tiny_model_dir)
    engine = HFEngine(tiny_model_dir)
    sampling = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    requests = pin_adapters([RolloutRequest(id="b", input_ids=[3, 4], sampling_params=sampling),
                             RolloutRequest(id="a", input_ids=[3, 4], adapter="sql", sampling_params=sampling)],
                            engine, redis_client, "default")
    before = [o[0].token_ids.tolist() for o in engine.generate(requests)]
    assert before == [greedy_reference(tiny_model_dir, None, [3, 4], 5),
                      greedy_reference(tiny_model_dir, adapter, [3, 4], 5)]
    store = WeightStore(f"file://{tmp_path}/weights")
    write_version(store, read_checkpoint(f"file://{v1_model_dir}"), 1)
    engine.apply_store_version(store, None, 1)
    after = [o[0].token_ids.tolist() for o in engine.generate(requests)]
    assert after == [greedy_reference(v1_model_dir, None, [3, 4], 5),
                     greedy_reference(v1_model_dir, adapter, [3, 4], 5)]
    assert after != before and engine.adapters.loads == 1  # not reloaded: the LoRA layers stayed
    engine.close()
