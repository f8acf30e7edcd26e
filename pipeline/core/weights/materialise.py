"""A store version as a checkpoint directory, for engines that load weights only from disk.

`materialise(store, version, directory, model_files)` writes the version's tensors, rebuilt from
its full version and the deltas after it one tensor at a time, as safetensors files of at most
`bucket_bytes` (with `model.safetensors.index.json` when there are several, as transformers,
SGLang and vLLM read them), next to the non-weight files of the model the engine serves
(`model_files`: config.json, generation config, tokenizer). It is written under a temporary name
and renamed when complete, so an engine never sees half a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.core.errors import StoreError
from pipeline.core.weights.safetensors_io import TensorBits, encode_file
from pipeline.core.weights.store import DEFAULT_BUCKET_BYTES, WeightStore

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
INDEX = "model.safetensors.index.json"


def check_model_files(source: Path) -> None:
    if not (source / "config.json").is_file():
        raise StoreError(f"the model the engine serves ({source}) has no config.json readable here: a store version "
                         "is loaded in full as a checkpoint directory, which needs the model's config; run the worker "
                         "where the model directory is readable, or push a checkpoint directory instead")


def copy_model_files(source: Path, directory: Path) -> None:
    """The non-weight files of the model directory `source` (config, tokenizer) into `directory`."""
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, directory / path.name)


def materialise(store: WeightStore, version: int, directory: Path, model_files: Path, *,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Write `version` as a checkpoint directory at `directory` (replaced if there); the store bytes read."""
    check_model_files(model_files)
    chain = store.chain(version)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    copy_model_files(model_files, partial)
    buckets: list[list[str]] = []
    pending: list[TensorBits] = []
    for entry in chain[-1].tensors:
        tensor = store.tensor(version, entry.name)
        assert tensor is not None
        if pending and sum(t.words.nbytes for t in pending) + tensor.words.nbytes > bucket_bytes:
            buckets.append(_write_bucket(partial, pending, len(buckets)))
            pending = []
        pending.append(tensor)
    buckets.append(_write_bucket(partial, pending, len(buckets)))
    weight_map = {}
    for number, names in enumerate(buckets):
        name = "model.safetensors" if len(buckets) == 1 else f"model-{number + 1:05d}-of-{len(buckets):05d}.safetensors"
        (partial / f"bucket-{number:05d}").rename(partial / name)
        weight_map.update(dict.fromkeys(names, name))
    if len(buckets) > 1:
        index = {"metadata": {"total_size": chain[-1].model_bytes}, "weight_map": weight_map}
        (partial / INDEX).write_text(json.dumps(index, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return sum(entry.length for manifest in chain for entry in manifest.tensors)


def _write_bucket(directory: Path, tensors: list[TensorBits], number: int) -> list[str]:
    data, _ = encode_file(tensors)
    (directory / f"bucket-{number:05d}").write_bytes(data)
    return [tensor.name for tensor in tensors]
