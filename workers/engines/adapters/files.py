"""Adapter versions as PEFT directories on disk, for inference servers that load LoRA from a path
(SGLang's `/load_lora_adapter`, vLLM's `/v1/load_lora_adapter`).

A pinned adapter version (`NAME@vN`, `schemas.adapters.pinned`) is written from its store under
the worker's adapter directory (`--adapter-dir`, a path the servers can read): its
`adapter_config.json`, as peft wrote it, and `adapter_model.safetensors`. A version's files never
change, so a directory is written once (renamed into place whole) and kept: servers shared by
several workers may read it again after an unload.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pipeline.core.adapters import CONFIG_FILE
from pipeline.core.weights.safetensors_io import TensorBits, encode_file
from schemas.adapters import AdapterRecord

WEIGHTS_FILE = "adapter_model.safetensors"


def default_directory() -> Path:
    """Where adapters are materialised when the worker is not told (`--adapter-dir`)."""
    return Path(tempfile.gettempdir()) / "rollout-adapters"


def materialise(root: Path, key: str, record: AdapterRecord, tensors: list[TensorBits]) -> Path:
    """Adapter version `key` as a PEFT directory under `root` (written once; renamed into place whole)."""
    target = root / key
    if (target / WEIGHTS_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    (staging / CONFIG_FILE).write_text(json.dumps(record.config))
    (staging / WEIGHTS_FILE).write_bytes(encode_file(tensors)[0])
    try:
        os.rename(staging, target)
    except OSError:  # another worker wrote the same version first
        for path in staging.iterdir():
            path.unlink()
        staging.rmdir()
    return target
