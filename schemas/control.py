"""The control channel's records: the desired state workers converge to, and their acks."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr


class DesiredState(BaseModel):
    """What every worker should be doing; `generation` grows by one on every change."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    generation: Annotated[StrictInt, Field(ge=0)] = 0
    paused: StrictBool = False
    weight_version: Annotated[StrictInt, Field(ge=0)] = 0
    # None: the weights the worker was started with.
    weight_path: StrictStr | None = None


class WeightAck(BaseModel):
    """A worker's answer to a weight push: loaded (`ok`) or not, how long it took, why not."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    worker: Annotated[StrictStr, Field(min_length=1)]
    version: StrictInt
    ok: StrictBool
    seconds: StrictFloat
    error: StrictStr | None = None
