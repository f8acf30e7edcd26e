"""A store version as a checkpoint directory (`pipeline.core.weights.materialise`), what engines that
load only from disk get: transformers loads it (sharded with an index, or one file) and holds the
version's exact bits, with the served model's config and tokenizer beside them; a model directory
without a config is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.core.errors import StoreError
from pipeline.core.weights.materialise import INDEX, materialise
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.writer import write_version
from tests.helpers.weights_trainer import Trainer, same_bits


@pytest.mark.parametrize("bucket_bytes", [64 * 1024, 1 << 30], ids=["sharded", "one-file"])
def test_a_delta_version_materialises_as_a_checkpoint_transformers_loads_bit_for_bit(
    tiny_model_dir: Path, tmp_path: Path, bucket_bytes: int
) -> None:
    store = WeightStore(str(tmp_path / "store"))
    trainer = Trainer(tiny_model_dir)
    write_version(store, state_dict_bits(trainer.model.state_dict()), 1)
    trainer.step()
    written = write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    assert written.manifest.kind == "delta"
    target = tmp_path / "loaded" / "v2"
    (tmp_path / "loaded" / "v2.partial").mkdir(parents=True)  # a materialisation that died half-way
    read = materialise(store, 2, target, tiny_model_dir, bucket_bytes=bucket_bytes)

    assert read == store.manifest(1).stored_bytes + store.manifest(2).stored_bytes
    assert sorted(p.name for p in (tmp_path / "loaded").iterdir()) == ["v2"]
    files = {p.name for p in target.iterdir()}
    assert {"config.json", "tokenizer.json"} <= files
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    if bucket_bytes < (1 << 20):
        assert len(shards) > 1 and INDEX in files
        assert set(json.loads((target / INDEX).read_text())["weight_map"].values()) == set(shards)
    else:
        assert shards == ["model.safetensors"] and INDEX not in files
    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert same_bits(loaded.state_dict(), trainer.model.state_dict())


def test_a_served_model_without_a_config_is_refused_before_anything_is_written(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = WeightStore(str(tmp_path / "store"))
    write_version(store, state_dict_bits(Trainer(tiny_model_dir).model.state_dict()), 1)
    (tmp_path / "no-config").mkdir()
    with pytest.raises(StoreError, match=r"the model the engine serves \(.*no-config\) has no config.json readable "
                                         "here.*push a checkpoint directory instead"):
        materialise(store, 1, tmp_path / "loaded" / "v1", tmp_path / "no-config")
    assert not (tmp_path / "loaded").exists()
