"""A worker's load of a version from a weight store (`pipeline.core.weights.store`), as its ack reports it.

`prepare_store_load(engine, url, version, have, scratch)` does everything that does not need the
engine stopped, while it keeps generating, and returns the part that does (`load()`, run in the
pause: between batches, or with the samples in flight interrupted in a partial swap):

- an engine with `stage_store_version` (hf): the new tensors computed from the version the engine
  serves (`have`) and the deltas, or from the full version, and every checksum checked, beside the
  engine's weights (`workers.engines.inplace.stage_version`); `load()` installs them;
- with `PIPELINE_WEIGHT_STAGING=off` (no memory for a staged copy), or an engine that has only
  `apply_store_version` (the vLLM worker extension): the whole apply, checks included, in `load()`;
- any other engine (sglang-http, sim, vllm-http without the extension): the version is
  materialised from the store into a checkpoint directory under `scratch`, with the non-weight
  files of the model the engine serves (`pipeline.core.weights.materialise`), and `load()` is the
  engine's own `update_weights` of it. The ack says `full` and why.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.core import settings
from pipeline.core.weights.materialise import materialise
from pipeline.core.weights.store import WeightStore, version_dir
from workers.engines.base import Engine, applies_store_versions, stages_store_versions
from workers.engines.http.engine import HTTPEngine

Load = Callable[[], dict[str, Any]]


def _how(applied: Any) -> dict[str, Any]:
    return {"applied": applied.how, "bytes_read": applied.bytes_read, "detail": applied.detail}


def scratch_dir(worker_id: str) -> Path:
    """Where a worker materialises store versions for an engine that loads from disk."""
    return settings.home() / "materialised" / re.sub(r"[^A-Za-z0-9._-]", "_", worker_id)


def served_model_dir(engine: Engine) -> Path:
    """The directory of the model the engine serves, as this worker sees it (an HTTP engine's
    `model_path`, which its server reports or its flags give; else the engine's model name)."""
    return Path(engine.model_path if isinstance(engine, HTTPEngine) else engine.description.model)


def prepare_store_load(engine: Engine, url: str, version: int, have: int | None, scratch: Path) -> Load:
    """Bring `engine` to `version` of the store at `url`, all but the pause; `load()` does the rest
    and returns the ack's `applied`, `bytes_read`, `detail`."""
    store = WeightStore(url)
    if stages_store_versions(engine) and settings.weight_staging():
        staged = engine.stage_store_version(store, have, version)
        return lambda: _how(engine.install_store_version(staged))
    if applies_store_versions(engine):
        return lambda: _how(engine.apply_store_version(store, have, version))
    directory = scratch / version_dir(version)
    read = materialise(store, version, directory, served_model_dir(engine))
    detail = (f"the {engine.description.name} engine cannot apply a delta in place: v{version} was rebuilt from the "
              f"store into {directory} and loaded in full")

    def load() -> dict[str, Any]:
        engine.update_weights(str(directory), version)
        for older in scratch.iterdir():  # what the engine served before: loaded, no longer read
            if older.name != directory.name:
                shutil.rmtree(older, ignore_errors=True)
        return {"applied": "full", "bytes_read": read, "detail": detail}

    return load
