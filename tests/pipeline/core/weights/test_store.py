"""The weight store on disk: full versions and deltas rebuild every version exactly; what is stored
is real safetensors; unfinished and damaged versions are invisible or refused, located; pruning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from pipeline.core.weights.safetensors_io import TensorBits, read_checkpoint
from pipeline.core.weights.store import StoreError, WeightStore, version_dir
from pipeline.weights.writer import write_version


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"embed": rng.normal(0, 0.02, (300, 16)).astype(np.float32),
            "norm": np.ones(16, np.float32), "head": rng.normal(0, 0.02, (16, 40)).astype(np.float32)}


def _bits(model: dict[str, np.ndarray]) -> list[TensorBits]:
    return [TensorBits(name, "F32", value.shape, value.reshape(-1).view(np.uint32)) for name, value in model.items()]


def _step(model: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    new = {name: value + rng.normal(0, 1e-6, value.shape).astype(np.float32) for name, value in model.items()}
    new["norm"] = model["norm"].copy()  # one tensor unchanged
    return new


def test_versions_rebuild_exactly_from_full_and_deltas(tmp_path: Path) -> None:
    store = WeightStore(f"file://{tmp_path}/store")
    rng = np.random.default_rng(0)
    models = [_model(rng)]
    for _ in range(4):
        models.append(_step(models[-1], rng))
    written = [write_version(store, _bits(m), v, full_every=3, bucket_bytes=4096) for v, m in enumerate(models)]
    assert [w.manifest.kind for w in written] == ["full", "delta", "delta", "full", "delta"]
    assert all(w.stored_bytes < w.model_bytes / 2 for w in written if w.manifest.kind == "delta")
    assert {t.name: t.encoding for t in written[1].manifest.tensors}["norm"] == "same"
    # The full v3 carries its delta against v2: a reader at v2 steps through it; a rebuild does not need it.
    steps = store.deltas_between(1, 4)
    assert steps is not None and [(m.version, m.kind) for m in steps] == [(2, "delta"), (3, "delta"), (4, "delta")]
    assert [m.version for m in store.chain(4)] == [3, 4] and written[3].manifest.delta is not None
    assert all(e.encoding == "plain" for e in written[3].manifest.tensors)
    for version, model in enumerate(models):
        for name, value in model.items():
            rebuilt = store.tensor(version, name)
            assert rebuilt is not None and rebuilt.shape == value.shape
            assert np.array_equal(rebuilt.words, value.reshape(-1).view(np.uint32))
    # A full version is plain safetensors, in buckets closed once they reach bucket_bytes: embed, norm + head.
    files = sorted((tmp_path / "store" / version_dir(0)).glob("full-*.safetensors"))
    assert len(files) == 2
    loaded = {}
    for file in files:
        with safe_open(str(file), "np") as handle:
            loaded.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    assert all(np.array_equal(loaded[name], models[0][name]) for name in models[0])
    assert [t.name for t in read_checkpoint(f"file://{tmp_path}/store/{version_dir(0)}")] == list(models[0])


def test_a_version_must_be_newer_and_an_unfinished_one_is_invisible(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path))
    rng = np.random.default_rng(1)
    model = _model(rng)
    write_version(store, _bits(model), 1)
    with pytest.raises(StoreError, match="version 1 is not newer than the stored version 1"):
        write_version(store, _bits(model), 1)

    def broken() -> list[TensorBits]:
        yield from _bits(_step(model, rng))[:1]
        raise RuntimeError("the trainer died mid-push")

    with pytest.raises(RuntimeError):
        write_version(store, broken(), 2)
    assert (tmp_path / version_dir(2)).exists() and store.versions() == [1]
    assert write_version(store, _bits(_step(model, rng)), 2).manifest.kind == "delta"  # replaces the leftovers
    assert store.versions() == [1, 2]


def test_a_damaged_manifest_is_refused_naming_file_and_field(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path))
    write_version(store, _bits(_model(np.random.default_rng(2))), 3)
    path = tmp_path / version_dir(3) / "manifest.json"
    record = json.loads(path.read_text())
    record["tensors"][0]["xxh3"] = "not a checksum"
    path.write_text(json.dumps(record))
    with pytest.raises(StoreError, match=r"v00000003/manifest.json: tensors\.0\.xxh3: String should match"):
        WeightStore(str(tmp_path)).manifest(3)
    record = json.loads(path.read_text().replace("not a checksum", "0" * 32))
    record["tensors"][0]["length"] = 10**10  # a reader would allocate what the manifest claims
    path.write_text(json.dumps(record))
    with pytest.raises(StoreError, match=r"tensor embed: 10000000000 bytes of plain data for a F32 tensor"):
        WeightStore(str(tmp_path)).manifest(3)


def test_prune_keeps_what_rebuilds_the_versions_still_needed(tmp_path: Path) -> None:
    store = WeightStore(str(tmp_path))
    rng = np.random.default_rng(3)
    model = _model(rng)
    for version in range(6):
        write_version(store, _bits(model), version, full_every=2)  # full at 0, 2, 4
        model = _step(model, rng)
    assert store.prune(3) == [0, 1]  # v3 is rebuilt from the full v2
    assert store.versions() == [2, 3, 4, 5]
    assert store.prune(5) == [2, 3]
    assert store.tensor(5, "embed") is not None and store.chain(5)[0].version == 4
