"""The job payload: one batch of rollout requests as it travels through Redis.

Jobs are JSON (RQ's JSON serializer, never pickle). Prompt token ids are packed into one
base64 string of little-endian int32 (about 5.3 bytes a token, before RQ's zlib) instead of
a JSON list of decimal numbers; or, on the fast submit path, kept out of the job as raw
little-endian bytes (uint16 when every id fits, else int32) under a side Redis key named by
`prompt_key`, written in the same transaction as the job (see `pipeline.submit.enqueue`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired, Protocol, TypedDict, Unpack

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from schemas import request as request_schema
from schemas.request import RolloutRequest

JOB_SCHEMA_VERSION = 1

_INT32_LE = np.dtype("<i4")
PromptDType = Literal["<i4", "<u2"]


def pack_token_ids(sequences: Sequence[Sequence[int]]) -> tuple[str, list[int]]:
    """Concatenate token id sequences into base64 int32 plus their lengths."""
    arrays = [np.asarray(seq, dtype=_INT32_LE) for seq in sequences]
    return base64.b64encode(_concatenate(arrays).astype(_INT32_LE).tobytes()).decode("ascii"), [a.size for a in arrays]


def unpack_token_ids(packed: str, lengths: Sequence[int]) -> list[np.ndarray]:
    """Inverse of `pack_token_ids`: one int32 array per sequence."""
    flat = np.frombuffer(base64.b64decode(packed, validate=True), dtype=_INT32_LE)
    if flat.size != sum(lengths):
        raise ValueError(f"packed token ids hold {flat.size} ids, lengths say {sum(lengths)}")
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else []


class PromptRequest(Protocol):
    """A validated request whose prompt ids are an array (`pipeline.submit.request_file.ParsedRequest`)."""

    prompt_ids: np.ndarray
    job_fields: dict[str, Any]


def _prompt_array(request: RolloutRequest | PromptRequest) -> np.ndarray:
    ids = getattr(request, "prompt_ids", None)
    return ids if ids is not None else np.asarray(request.input_ids, dtype=np.int64)


def _concatenate(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


class TurnTag(BaseModel):
    """An agent turn (`pipeline serve`): one call of a session, answered from its rows.

    A job of turns holds the turns that reached a server together, one request
    each (`turns` parallel to `requests`). Their rows are not a shard of the job's own: the worker
    logs each turn's rows in the run's turn log and answers its server under `turn_id`; a flusher
    writes many turns to one shard (`workers.jobs.turn_commits`).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    turn_id: Annotated[StrictStr, Field(min_length=1, max_length=200)]
    session_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    turn: Annotated[StrictInt, Field(ge=0)]
    prefix_break: StrictBool = False
    # The call this one extends in its session's tree (None: a root): its turn and chosen sample.
    parent_turn: Annotated[StrictInt, Field(ge=0)] | None = None
    parent_sample: Annotated[StrictInt, Field(ge=0)] | None = None
    # The call asked for `stream=True`: the worker publishes the turn's tokens as they are generated
    # (`pipeline.core.jobs.turn_stream`), not only its rows at the end.
    stream: StrictBool = False
    # The server waiting for the answer: its inbox (`keys.serve_inbox`) is where the rows go.
    reply_to: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class JobHeader(TypedDict):
    """What every job of a submit says besides its requests."""

    run: str
    job_id: str
    batch_id: str
    output: str
    submitted_at_ms: int
    min_weight_version: NotRequired[int | None]
    max_staleness: NotRequired[int | None]
    turns: NotRequired[list[TurnTag] | None]


def _job_fields(request: RolloutRequest | PromptRequest) -> dict[str, Any]:
    if isinstance(request, RolloutRequest):
        return request.model_dump(exclude={"input_ids"}, exclude_defaults=True)
    return request.job_fields


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
    # The staleness bound: no committed sample holds a token from a version more than this many
    # behind the worker's current one (samples that would are generated again from the start).
    max_staleness: Annotated[StrictInt, Field(ge=0)] | None = None
    prompt_tokens: StrictStr = ""
    # Set instead of prompt_tokens: the Redis key holding the raw ids, and their dtype.
    prompt_key: StrictStr | None = None
    prompt_dtype: PromptDType = "<i4"
    prompt_lengths: list[Annotated[StrictInt, Field(ge=1)]]
    # Each request line without its input_ids (those are in prompt_tokens), defaults omitted.
    requests: list[dict[str, Any]]
    # Set on the jobs of agent turns (`pipeline serve`), one per request: where the rows go and
    # whom to answer.
    turns: list[TurnTag] | None = None

    @classmethod
    def pack(cls, requests: Sequence[RolloutRequest | PromptRequest], **header: Unpack[JobHeader]) -> JobPayload:
        """The payload with the prompt ids inside it, as base64 little-endian int32."""
        arrays = [_prompt_array(r) for r in requests]
        packed = base64.b64encode(_concatenate(arrays).astype(_INT32_LE).tobytes()).decode("ascii")
        return cls(**header, prompt_tokens=packed, prompt_lengths=[a.size for a in arrays],
                   requests=[_job_fields(r) for r in requests])

    @classmethod
    def pack_beside(
        cls, requests: Sequence[RolloutRequest | PromptRequest], *, prompt_key: str, **header: Unpack[JobHeader]
    ) -> tuple[JobPayload, bytes]:
        """The payload without the ids, and the ids as raw bytes to store under `prompt_key`.

        uint16 when every id fits (2 bytes a token), else int32; nothing for RQ to compress.
        `requests` are models or already validated lines carrying their ids as an array
        (`pipeline.submit.request_file.ParsedRequest`), packed without a Python list per prompt.
        """
        arrays = [_prompt_array(r) for r in requests]
        return cls.pack_flat([_job_fields(r) for r in requests], _concatenate(arrays), [a.size for a in arrays],
                             prompt_key=prompt_key, **header)

    @classmethod
    def pack_flat(
        cls, job_fields: list[dict[str, Any]], flat: np.ndarray, lengths: list[int], *, prompt_key: str,
        **header: Unpack[JobHeader],
    ) -> tuple[JobPayload, bytes]:
        """`pack_beside` of requests given as their job fields and all their prompt ids in one array
        (`lengths` ids each, in order): one copy of the ids into the value to stage."""
        dtype: PromptDType = "<u2" if flat.size == 0 or int(flat.max()) < 2**16 else "<i4"
        payload = cls(**header, prompt_key=prompt_key, prompt_dtype=dtype, prompt_lengths=lengths,
                      requests=job_fields)
        return payload, flat.astype(dtype).tobytes()

    def as_json(self) -> dict[str, Any]:
        """The payload as a job carries it (the job function's one argument, a turn job's `payload`):
        its request dicts, plain JSON already from validated lines, are not walked again."""
        return {**self.model_dump(mode="json", exclude={"requests"}), "requests": self.requests}

    def unpack(self, prompt_bytes: bytes | None = None) -> list[RolloutRequest]:
        """The requests, re-validated: a worker trusts nothing it reads from Redis.

        `prompt_bytes` is the value of `prompt_key` when the ids travel beside the job.
        """
        if self.schema_version != JOB_SCHEMA_VERSION:
            raise ValueError(
                f"job schema_version {self.schema_version} is not {JOB_SCHEMA_VERSION}; "
                "submitter and worker run different releases"
            )
        if len(self.requests) != len(self.prompt_lengths):
            raise ValueError("job payload has a different number of requests and prompts")
        if self.turns is not None and len(self.turns) != len(self.requests):
            raise ValueError("job payload has a different number of requests and agent turns")
        if self.prompt_key is None:
            prompts = unpack_token_ids(self.prompt_tokens, self.prompt_lengths)
            return [
                RolloutRequest.model_validate({**fields, "input_ids": ids.tolist()})
                for fields, ids in zip(self.requests, prompts, strict=True)
            ]
        if prompt_bytes is None:
            raise ValueError(f"job {self.job_id}: its prompt token ids (Redis key {self.prompt_key}) are missing")
        dtype = np.dtype(self.prompt_dtype)
        total = sum(self.prompt_lengths)
        if len(prompt_bytes) != total * dtype.itemsize:
            raise ValueError(
                f"job {self.job_id}: {self.prompt_key} holds {len(prompt_bytes)} bytes, "
                f"the prompt lengths say {total} ids of {dtype.itemsize} bytes"
            )
        flat = np.frombuffer(prompt_bytes, dtype=dtype)
        if flat.size and int(flat.min()) < 0:
            raise ValueError(f"job {self.job_id}: a prompt token id is negative")
        if max(self.prompt_lengths, default=0) > request_schema.MAX_PROMPT_TOKENS:
            limit = request_schema.MAX_PROMPT_TOKENS
            raise ValueError(f"job {self.job_id}: a prompt is over the limit of {limit} tokens")
        offsets = np.cumsum([0, *self.prompt_lengths])
        out = []
        for fields, start, end in zip(self.requests, offsets[:-1], offsets[1:], strict=True):
            # Every field but the ids through the model; the ids were checked above as an array.
            request = RolloutRequest.model_validate({**fields, "input_ids": [0]})
            out.append(request.model_copy(update={"input_ids": flat[start:end].tolist()}))
        return out
