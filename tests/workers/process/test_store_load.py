"""A worker's store load in two halves (`workers.process.store_load.prepare_store_load`): the
preparation leaves the engine serving its version, the load that follows (the pause) brings it to
the new one bit for bit; with `PIPELINE_WEIGHT_STAGING=off` the whole apply waits for the load."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.writer import write_version
from tests.helpers.weights_trainer import Trainer, same_bits
from workers.engines.hf.engine import HFEngine
from workers.process.store_load import prepare_store_load


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_prepared_store_load_changes_the_engine_only_when_loaded(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staging: str
) -> None:
    monkeypatch.setenv("PIPELINE_WEIGHT_STAGING", staging)
    url = f"file://{tmp_path}/store"
    trainer = Trainer(tiny_model_dir)
    write_version(WeightStore(url), state_dict_bits(trainer.model.state_dict()), 1)
    engine = HFEngine(tiny_model_dir)
    assert prepare_store_load(engine, url, 1, None, tmp_path / "scratch")()["applied"] == "full"
    trainer.step()
    write_version(WeightStore(url), state_dict_bits(trainer.model.state_dict()), 2)
    v1 = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}

    load = prepare_store_load(engine, url, 2, 1, tmp_path / "scratch")
    assert same_bits(engine.model.state_dict(), v1) and engine.weight_version == 1
    assert load() == {"applied": "delta", "bytes_read": WeightStore(url).manifest(2).stored_bytes, "detail": None}
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict()) and engine.weight_version == 2
    assert not (tmp_path / "scratch").exists()  # an engine that applies deltas needs no checkpoint on disk
