"""Store versions staged beside an hf engine's weights and installed in its pause
(`workers.engines.inplace.stage_version`): nothing of the engine changes until the install, the
install is bit for bit (a parameter swapped, or only its changed elements written, tied
embeddings included), and a version that does not check out is refused with the engine untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.core.errors import WeightsMismatchError
from pipeline.core.weights.store import WeightStore
from pipeline.core.weights.torch_bits import state_dict_bits
from pipeline.weights.writer import write_version
from tests.helpers.weights_trainer import Trainer, corrupt_a_delta, same_bits
from workers.engines.hf.engine import HFEngine


def _snapshot(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}


def _engine_at_v1(model_dir: Path, store: WeightStore) -> tuple[HFEngine, Trainer]:
    trainer = Trainer(model_dir)
    write_version(store, state_dict_bits(trainer.model.state_dict()), 1)
    engine = HFEngine(model_dir)
    engine.install_store_version(engine.stage_store_version(store, None, 1))
    return engine, trainer


def test_a_staged_delta_changes_nothing_until_installed_then_every_tensor_is_the_trainers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = WeightStore(str(tmp_path / "store"))
    engine, trainer = _engine_at_v1(tiny_model_dir, store)
    v1 = _snapshot(engine)
    trainer.step()  # AdamW: every element of every trained tensor moves (installed by a swap)
    write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    staged = engine.stage_store_version(store, 1, 2)
    assert same_bits(engine.model.state_dict(), v1) and engine.weight_version == 1  # still serving v1
    applied = engine.install_store_version(staged)
    assert (applied.how, applied.version, engine.weight_version) == ("delta", 2, 2)
    assert applied.bytes_read == store.manifest(2).stored_bytes
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict())
    # A later delta starts from the installed tensors, as from any others.
    trainer.step()
    write_version(store, state_dict_bits(trainer.model.state_dict()), 3)
    assert engine.install_store_version(engine.stage_store_version(store, 2, 3)).how == "delta"
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict())


def test_a_few_changed_elements_are_staged_and_installed_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "store"))
    engine, trainer = _engine_at_v1(tiny_model_dir, store)
    weight = trainer.model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    with torch.no_grad():
        weight[0, :3] += 0.25  # 3 elements of one tensor: what a bf16 step at lr 1e-6 looks like
    write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    staged = engine.stage_store_version(store, 1, 2)
    assert staged.staged_bytes <= 3 * (4 + 8)  # values and indices, not a copy of the tensor
    engine.install_store_version(staged)
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict())


def test_tied_embeddings_are_installed_once_and_stay_tied(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    store = WeightStore(str(tmp_path / "store"))
    engine, trainer = _engine_at_v1(tmp_path / "tied", store)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    for version in (2, 3):
        trainer.step()
        write_version(store, state_dict_bits(trainer.model.state_dict()), version)
        engine.install_store_version(engine.stage_store_version(store, version - 1, version))
        assert same_bits(engine.model.state_dict(), trainer.model.state_dict())
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def test_a_delta_over_drifted_weights_is_staged_from_the_full_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "store"))
    engine, trainer = _engine_at_v1(tiny_model_dir, store)
    trainer.step()
    write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    with torch.no_grad():  # the engine no longer holds v1 exactly (a bug, a stray write)
        engine.model.state_dict()["model.norm.weight"][0] += 1.0
    applied = engine.install_store_version(engine.stage_store_version(store, 1, 2))
    assert applied.how == "full" and "model.norm.weight" in (applied.detail or "")
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict()) and engine.weight_version == 2


def test_a_corrupt_store_is_refused_before_anything_is_installed(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path / "store"))
    engine, trainer = _engine_at_v1(tiny_model_dir, store)
    v1 = _snapshot(engine)
    trainer.step()
    written = write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    entry = corrupt_a_delta(tmp_path / "store", written.manifest)  # the delta's bytes lost on disk
    with pytest.raises(WeightsMismatchError, match=rf"{entry.name}.*nothing was installed, the engine's weights are "
                                                   "unchanged; push the weights again as a new full version"):
        engine.stage_store_version(WeightStore(str(tmp_path / "store")), 1, 2)
    assert same_bits(engine.model.state_dict(), v1) and engine.weight_version == 1
