"""The request line: one rollout request of a JSONL file, validated strictly.

Sampling parameter names are SGLang's. Unknown fields, wrong types and booleans where a
number belongs are errors, so that a typo never silently does nothing. The stop contract's
input side lives here: `stop` is a string, a list of strings, or a list of token ids.

Size limits (each overridable by the environment variable named in its error): the prompt
length, the number and length of stops, the metadata's JSON size, and `MAX_LINE_BYTES` for a
whole JSONL line (checked by `pipeline.submit.request_file`). `max_new_tokens`, `n` and `logprobs`
have fixed bounds in the schema.

The one home of these rules: the file path (`pipeline.submit.request_file`) and the dataset path
(`pipeline.submit.dataset_input`) check their fast cases against the constants here and word
their errors with the functions here (`prompt_too_long`, `outside_vocabulary`); the chat line's
fields are `schemas.chat`'s.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

from schemas.adapters import AdapterName

# Token ids travel as int32 in job payloads and shards; seeds as int64.
MAX_TOKEN_ID = 2**31 - 1
MAX_SEED = 2**63 - 1
# Fixed bounds of the request line (the file path's and the dataset path's fast checks use them too).
MAX_ID_CHARS = 512
# A routing key travels as an HTTP header (SGLang's gateway `smg` ignores keys over 128 bytes).
MAX_ROUTING_KEY_CHARS = 128
MAX_LOGPROBS = 1024
# Only 0 (the prompt token's own logprob): shards have no column for prompt alternatives.
MAX_PROMPT_LOGPROBS = 0


# The size limits: environment variable -> (default, meaning). Read here, once, at import, the
# only variables not read by `pipeline.core.settings` (which lists these from here): `schemas`
# imports nothing from `pipeline`.
LIMITS: dict[str, tuple[int, str]] = {
    "PIPELINE_MAX_LINE_BYTES": (8 * 1024 * 1024, "longest request line accepted at submit (bytes)"),
    "PIPELINE_MAX_PROMPT_TOKENS": (262_144, "longest prompt (tokens)"),
    "PIPELINE_MAX_STOPS": (64, "most stop strings, or stop token ids, per request"),
    "PIPELINE_MAX_STOP_CHARS": (1024, "longest stop string (characters)"),
    "PIPELINE_MAX_METADATA_BYTES": (64 * 1024, "largest `metadata` object (bytes of JSON)"),
}


def _limit(env: str) -> int:
    value = os.environ.get(env)
    return int(value) if value else LIMITS[env][0]


MAX_LINE_BYTES = _limit("PIPELINE_MAX_LINE_BYTES")
MAX_PROMPT_TOKENS = _limit("PIPELINE_MAX_PROMPT_TOKENS")
MAX_STOPS = _limit("PIPELINE_MAX_STOPS")
MAX_STOP_CHARS = _limit("PIPELINE_MAX_STOP_CHARS")
MAX_METADATA_BYTES = _limit("PIPELINE_MAX_METADATA_BYTES")

# `json.dumps(value, ensure_ascii=False, allow_nan=False)` without building an encoder per call.
_METADATA_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def encode_metadata(value: dict[str, Any]) -> bytes:
    """Metadata as the JSON whose size `MAX_METADATA_BYTES` limits; ValueError when not plain JSON."""
    return _METADATA_ENCODER.encode(value).encode()


def prompt_too_long(tokens: int) -> str:
    """Why a prompt of `tokens` tokens (over `MAX_PROMPT_TOKENS`) is refused."""
    return f"prompt of {tokens} tokens, over the limit of {MAX_PROMPT_TOKENS} (PIPELINE_MAX_PROMPT_TOKENS)"


def outside_vocabulary(token_id: int, vocab_size: int) -> str:
    """Why a request naming `token_id` is refused for a model of `vocab_size` tokens."""
    return f"token id {token_id} is outside the model's vocabulary of {vocab_size}"


TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Number = StrictFloat | StrictInt


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class SamplingParams(_Strict):
    """SGLang's sampling parameters (`sampling/sampling_params.py`), plus `seed`."""

    max_new_tokens: Annotated[StrictInt, Field(ge=0, le=1_000_000)] = 128
    temperature: Annotated[Number, Field(ge=0.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.0
    n: Annotated[StrictInt, Field(ge=1, le=1024)] = 1
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stop: StrictStr | list[StrictStr] | list[TokenId] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False
    no_stop_trim: StrictBool = False
    skip_special_tokens: StrictBool = True
    min_new_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=2.0)] = 1.0

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (all tokens) or a positive number, not 0")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        # Give the precise reason before pydantic's union error, which is hard to read.
        if value is None or isinstance(value, str):
            if value == "":
                raise ValueError("an empty stop string would match everywhere; remove it")
            return value
        if isinstance(value, bool):
            raise ValueError("stop must be a string, a list of strings or a list of token ids, not a bool")
        if isinstance(value, int | float):
            raise ValueError(
                f"stop: {value} is a bare number; for a token-id stop write a list: [{value}]"
            )
        if not isinstance(value, list):
            raise ValueError("stop must be a string, a list of strings or a list of token ids")
        kinds = set()
        for element in value:
            if isinstance(element, bool):
                raise ValueError("stop lists hold strings or token ids, not bools")
            if isinstance(element, str):
                if element == "":
                    raise ValueError("an empty stop string would match everywhere; remove it")
                kinds.add("str")
            elif isinstance(element, int):
                if element < 0:
                    raise ValueError(f"token-id stop {element} is negative; token ids are >= 0")
                kinds.add("int")
            else:
                raise ValueError(f"stop list element {element!r} is neither a string nor a token id")
        if len(kinds) > 1:
            raise ValueError(
                "stop mixes strings and token ids; put token ids in stop_token_ids instead"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stops, over the limit of {MAX_STOPS} (PIPELINE_MAX_STOPS)")
        for stop in stops:
            if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                raise ValueError(
                    f"a stop string of {len(stop)} characters, over the limit of {MAX_STOP_CHARS} "
                    "(PIPELINE_MAX_STOP_CHARS)"
                )
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_limit(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOPS:
            raise ValueError(f"{len(value)} stop token ids, over the limit of {MAX_STOPS} (PIPELINE_MAX_STOPS)")
        return value

    @property
    def greedy(self) -> bool:
        """SGLang treats temperatures below 1e-6 as greedy decoding."""
        return self.temperature < 1e-6

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The user's string stops (literal, `"token_id:576"` included)."""
        if isinstance(self.stop, str):
            return (self.stop,)
        if self.stop and isinstance(self.stop[0], str):
            return tuple(self.stop)  # type: ignore[arg-type]
        return ()

    @property
    def user_stop_token_ids(self) -> tuple[int, ...]:
        """Token-id stops from `stop` and `stop_token_ids`, merged, in order, de-duplicated."""
        ids: list[int] = []
        if isinstance(self.stop, list) and self.stop and isinstance(self.stop[0], int):
            ids.extend(self.stop)  # type: ignore[arg-type]
        ids.extend(self.stop_token_ids or ())
        return tuple(dict.fromkeys(ids))


class RolloutRequest(_Strict):
    """One line of a rollouts JSONL file."""

    id: Annotated[StrictStr, Field(min_length=1, max_length=MAX_ID_CHARS)]
    input_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: SamplingParams = SamplingParams()
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = 0
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_PROMPT_LOGPROBS)] | None = None
    return_routed_experts: StrictBool = False
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Set by the chat renderer (`pipeline.submit.render`): the text the ids were rendered from, kept in the row.
    prompt_text: StrictStr | None = None
    routing_key: Annotated[StrictStr, Field(
        min_length=1, max_length=MAX_ROUTING_KEY_CHARS, pattern=r"^[!-~]+$",
        description="Requests with the same key go to the same server of a worker, while it is up and not "
                    "overloaded (so they find each other's prefix in its KV cache); 1-128 visible ASCII "
                    "characters. `pipeline serve` sets it to the session id.",
    )] | None = None
    adapter: AdapterName | None = None

    @field_validator("input_ids")
    @classmethod
    def _prompt_limit(cls, value: list[int]) -> list[int]:
        if len(value) > MAX_PROMPT_TOKENS:
            raise ValueError(prompt_too_long(len(value)))
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limit(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(encode_metadata(value))
        except ValueError as exc:
            raise ValueError(f"metadata must be plain JSON ({exc})") from exc
        if size > MAX_METADATA_BYTES:
            raise ValueError(
                f"metadata is {size} bytes of JSON, over the limit of {MAX_METADATA_BYTES} "
                "(PIPELINE_MAX_METADATA_BYTES)"
            )
        return value

    def max_token_id(self) -> int:
        """The largest token id the request names (prompt and token-id stops)."""
        return max((*self.input_ids, *self.sampling_params.user_stop_token_ids))

    @property
    def sampling_shape(self) -> SamplingParams:
        """`sampling_params`, as the capability rules read them (`schemas.capabilities.Asks`)."""
        return self.sampling_params

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The user's string stops (`sampling_params.stop_strings`)."""
        return self.sampling_params.stop_strings
