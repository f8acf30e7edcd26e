"""LoRA adapters on SGLang servers (launched with `--enable-lora`): materialised, loaded by name.

A pinned adapter version (`NAME@vN`, `schemas.adapters.pinned`) is written from its store to a
PEFT directory under the worker's adapter directory (`adapter_config.json`, as peft wrote it, and
`adapter_model.safetensors`), then loaded on every server under its pinned name with
`POST /load_lora_adapter {"lora_name", "lora_path"}`; a `/generate` call names it in `lora_path`.
Evicted ones are unloaded with `POST /unload_lora_adapter {"lora_name"}` (SGLang 0.5.23,
`srt/managers/io_struct.py`: `LoadLoRAAdapterReqInput`, `UnloadLoRAAdapterReqInput`,
`GenerateReqInput.lora_path`; answers `LoRAUpdateOutput` `{"success", "error_message",
"loaded_adapters"}`, 400 when not a success). The directory is kept after an unload: SGLang
reloads an adapter it unloaded from its path when a request names it again (servers shared by
several workers), and a version's files never change.

A server that lost an adapter (restarted) answers `/generate` 400 "Got LoRA adapter that has never
been loaded" (`tokenizer_manager._resolve_lora_path`): the call is refused, the job handed back,
and the adapter forgotten as resident, so it is loaded again before it runs here next.
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
# SGLang's `/generate` answer for a `lora_path` it has no record of (never loaded, or lost in a restart).
NEVER_LOADED = "Got LoRA adapter that has never been loaded"
# SGLang's `/load_lora_adapter` answer for a name it already serves (a version's files never change).
ALREADY_LOADED = "already loaded"


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
