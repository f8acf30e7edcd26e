"""A trainer's in-memory model to every worker of a pool as the next weight version.

One function, `push_model`, so that the way weights travel is one line to change: today through a
directory (`save_pretrained` into `store`, then `Client.push_weights(path)`); once
`Client.push_weights(state_dict=...)` (issue 32) lands, straight from memory. The directory of the
version before is removed once every worker has acknowledged the new one (none still loads it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.broker.control_channel import DEFAULT_PUSH_TIMEOUT_S, PushResult
from pipeline.client import Client
from schemas.control import SwapMode


def next_version(client: Client) -> int:
    """The pool's current weight version + 1."""
    return client.control_state().weight_version + 1


def push_model(client: Client, model: Any, *, store: str | Path, mode: SwapMode = "partial",
               version: int | None = None, timeout: float | None = DEFAULT_PUSH_TIMEOUT_S) -> PushResult:
    """Every worker of `client`'s pool loads `model` (a transformers `PreTrainedModel`) as `version`
    (default: the pool's next). Returns when all live workers acknowledged (`WeightPushError` naming
    those that did not)."""
    version = next_version(client) if version is None else version
    root = Path(store)
    path = root / f"v{version}"
    model.save_pretrained(path)
    result = client.push_weights(str(path), version=version, mode=mode, timeout=timeout)
    for old in root.glob("v*"):
        if old != path and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return result
