"""Reading a model directory's config.json: text_config first, nothing when unreadable."""

from __future__ import annotations

import json
from pathlib import Path

from workers.engines import model_config


def _write(directory: Path, config: object) -> Path:
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_multimodal_config_is_read_from_its_text_config(tmp_path: Path) -> None:
    directory = _write(tmp_path, {"vocab_size": 10, "text_config": {"vocab_size": 32000, "tie_word_embeddings": True}})
    assert model_config.vocab_size(directory) == 32000
    assert model_config.ties_embeddings(directory)
    assert model_config.language_config(directory) == {"vocab_size": 32000, "tie_word_embeddings": True}


def test_the_top_level_answers_where_text_config_is_silent(tmp_path: Path) -> None:
    directory = _write(tmp_path, {"vocab_size": 49152, "tie_word_embeddings": False, "text_config": {}})
    assert model_config.vocab_size(directory) == 49152
    assert not model_config.ties_embeddings(directory)


def test_a_missing_or_broken_config_says_nothing(tmp_path: Path) -> None:
    assert model_config.model_configs(tmp_path / "missing") == []
    assert model_config.vocab_size(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert model_config.language_config(tmp_path) is None
    assert not model_config.ties_embeddings(tmp_path)
    _write(tmp_path, [1, 2])
    assert model_config.model_configs(tmp_path) == []
