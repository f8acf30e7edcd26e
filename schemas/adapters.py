"""LoRA adapters: their names, and the record of a pool's current version of one.

A request names an adapter (`RolloutRequest.adapter`); `pipeline weights push --adapter NAME DIR`
stores a version of it and publishes an `AdapterRecord` in the pool's adapter registry
(`pipeline.core.adapters`). Inside a worker a job's requests carry the version they run under
pinned to the name (`pinned`), so every sample of a job, continued or not, runs on one version.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
AdapterName = Annotated[StrictStr, Field(
    pattern=ADAPTER_NAME_PATTERN,
    description="A LoRA adapter pushed to the pool (`pipeline weights push --adapter NAME DIR`): 1-64 letters, "
                "digits, '_', '.' or '-'. Without one the request runs on the base weights.",
)]
_PIN = "@v"


class AdapterRecord(BaseModel):
    """A pool's current version of an adapter: where it is stored and what it fits."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    name: AdapterName
    version: Annotated[StrictInt, Field(ge=1)]
    # The adapter's own weight store (`pipeline.core.weights.store`): one version directory per push.
    url: Annotated[StrictStr, Field(min_length=1, max_length=4096)]
    rank: Annotated[StrictInt, Field(ge=1)]
    target_modules: list[StrictStr]
    # The adapter's `adapter_config.json`, as peft wrote it (what an engine builds the adapter from).
    config: dict[str, Any]
    stored_bytes: Annotated[StrictInt, Field(ge=0)] = 0


def pinned(name: str, version: int) -> str:
    """A request's adapter with the version its job runs under (`sql@v3`): inside a worker only."""
    return f"{name}{_PIN}{version}"


def split_pinned(adapter: str) -> tuple[str, int | None]:
    """(name, version) of a pinned adapter; (name, None) of a bare name."""
    name, sep, version = adapter.rpartition(_PIN)
    return (name, int(version)) if sep and version.isdigit() else (adapter, None)
