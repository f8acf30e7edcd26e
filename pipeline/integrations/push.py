"""A trainer's in-memory model to every worker of a pool as the next weight version.

One function, `push_model`, so that the way weights travel is one line: from memory through the
pool's weight store (`Client.push_weights(state_dict=...)`: a delta against the version before,
applied in place by the workers; docs/control.md "Pushes from memory"). A trainer without a
store shared with its workers would `save_pretrained` into a directory they can read and push
its path instead (`Client.push_weights(path, ...)`).
"""

from __future__ import annotations

from typing import Any

from pipeline.client import Client
from pipeline.core.adapters import DEFAULT_KEEP_VERSIONS
from pipeline.core.broker.control_channel import DEFAULT_PUSH_TIMEOUT_S, PushResult
from pipeline.weights.adapter_push import AdapterPushResult
from schemas.control import SwapMode


def next_version(client: Client) -> int:
    """The pool's current weight version + 1."""
    return client.control_state().weight_version + 1


def push_model(client: Client, model: Any, *, mode: SwapMode = "partial", store: str | None = None,
               version: int | None = None, timeout: float | None = DEFAULT_PUSH_TIMEOUT_S) -> PushResult:
    """Every worker of `client`'s pool loads `model`'s weights (a torch module) as `version` (default:
    the pool's next), through the weight store `store` (an fsspec URL the workers read; default
    `<PIPELINE_HOME>/weights/<pool>`). Returns when all live workers acknowledged
    (`WeightPushError` naming those that did not)."""
    version = next_version(client) if version is None else version
    return client.push_weights(state_dict=model.state_dict(), version=version, mode=mode, store=store,
                               timeout=timeout)


def push_adapter(client: Client, model: Any, name: str, *, adapter_name: str = "default",
                 base: str | None = None, store: str | None = None,
                 keep: int = DEFAULT_KEEP_VERSIONS, timeout: float | None = 600.0) -> AdapterPushResult:
    """A peft model's LoRA adapter (`adapter_name`) to the pool as the next version of adapter `name`
    (`Client.push_adapter`, `base`, `keep` and `timeout` as there): megabytes, not the model; returns
    once the pool's workers serving adapters acknowledged it: jobs admitted after that run it."""
    return client.push_adapter(name, model, adapter_name=adapter_name, base=base, store=store, keep=keep,
                               timeout=timeout)
