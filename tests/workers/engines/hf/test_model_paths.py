"""A weight path that is not there says so ("does not exist"), one that is not a model says "no config.json";
either way the engine keeps the weights it had."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engines.hf.engine import HFEngine
from workers.errors import EngineUnavailableError


def test_a_missing_weight_path_is_reported_as_missing_and_a_directory_without_config_as_no_model(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = HFEngine(tiny_model_dir)
    with pytest.raises(EngineUnavailableError, match=r"no-such-checkpoint does not exist \(as this worker sees it\)"):
        engine.update_weights(str(tmp_path / "no-such-checkpoint"), 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineUnavailableError, match=r"empty is not a transformers model directory \(no config.json\)"):
        engine.update_weights(str(tmp_path / "empty"), 1)
    with pytest.raises(EngineUnavailableError, match="does not exist"):
        HFEngine(tmp_path / "no-such-model")
    assert engine.weight_version == 0
