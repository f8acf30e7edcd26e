"""The job payload: one batch of rollout requests as it travels through Redis.

Jobs are JSON (RQ's JSON serializer, never pickle). Prompt token ids are packed into one
base64 string of little-endian int32 (about 5.3 bytes a token, before RQ's zlib) instead of
a JSON list of decimal numbers.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from schemas.request import RolloutRequest

JOB_SCHEMA_VERSION = 1

_INT32_LE = np.dtype("<i4")


def pack_token_ids(sequences: Sequence[Sequence[int]]) -> tuple[str, list[int]]:
    """Concatenate token id sequences into base64 int32 plus their lengths."""
    lengths = [len(seq) for seq in sequences]
    arrays = [np.asarray(seq, dtype=_INT32_LE) for seq in sequences]
    flat = np.concatenate(arrays) if arrays else np.empty(0, dtype=_INT32_LE)
    return base64.b64encode(flat.tobytes()).decode("ascii"), lengths


def unpack_token_ids(packed: str, lengths: Sequence[int]) -> list[np.ndarray]:
    """Inverse of `pack_token_ids`: one int32 array per sequence."""
    flat = np.frombuffer(base64.b64decode(packed, validate=True), dtype=_INT32_LE)
    if flat.size != sum(lengths):
        raise ValueError(f"packed token ids hold {flat.size} ids, lengths say {sum(lengths)}")
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else []


class JobPayload(BaseModel):
    """The single JSON argument of the project's job function."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    schema_version: StrictInt = JOB_SCHEMA_VERSION
    run: Annotated[StrictStr, Field(min_length=1)]
    job_id: Annotated[StrictStr, Field(min_length=1)]
    batch_id: Annotated[StrictStr, Field(min_length=1)]
    output: Annotated[StrictStr, Field(min_length=1)]
    submitted_at_ms: StrictInt
    min_weight_version: StrictInt | None = None
    prompt_tokens: StrictStr
    prompt_lengths: list[Annotated[StrictInt, Field(ge=1)]]
    # Each request line without its input_ids (those are in prompt_tokens), defaults omitted.
    requests: list[dict[str, Any]]

    @classmethod
    def pack(
        cls,
        requests: Sequence[RolloutRequest],
        *,
        run: str,
        job_id: str,
        batch_id: str,
        output: str,
        submitted_at_ms: int,
        min_weight_version: int | None = None,
    ) -> JobPayload:
        packed, lengths = pack_token_ids([r.input_ids for r in requests])
        return cls(
            run=run,
            job_id=job_id,
            batch_id=batch_id,
            output=output,
            submitted_at_ms=submitted_at_ms,
            min_weight_version=min_weight_version,
            prompt_tokens=packed,
            prompt_lengths=lengths,
            requests=[r.model_dump(exclude={"input_ids"}, exclude_defaults=True) for r in requests],
        )

    def unpack(self) -> list[RolloutRequest]:
        """The requests, re-validated: a worker trusts nothing it reads from Redis."""
        if self.schema_version != JOB_SCHEMA_VERSION:
            raise ValueError(
                f"job schema_version {self.schema_version} is not {JOB_SCHEMA_VERSION}; "
                "submitter and worker run different releases"
            )
        if len(self.requests) != len(self.prompt_lengths):
            raise ValueError("job payload has a different number of requests and prompts")
        prompts = unpack_token_ids(self.prompt_tokens, self.prompt_lengths)
        return [
            RolloutRequest.model_validate({**fields, "input_ids": ids.tolist()})
            for fields, ids in zip(self.requests, prompts, strict=True)
        ]
