"""OpenAI's request bodies as `pipeline serve` accepts them, validated strictly, and their sampling.

`ChatCompletionBody` is OpenAI's Chat Completions request (messages, tools, tool_choice,
temperature, top_p, max_tokens / max_completion_tokens, n, stop, seed, logprobs and
top_logprobs, stream) plus SGLang's sampling extras in the body (top_k, min_p, the penalties,
min_tokens, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, chat_template_kwargs,
separate_reasoning). `CompletionBody` is `/v1/completions` with a text prompt or token ids.

Unknown fields are errors (a typo must not silently do nothing), except the fields agent
clients send that change nothing here, which are accepted and ignored: `IGNORED_FIELDS`.
Messages and tools are the request-line models (`schemas.chat`), so a turn renders exactly as
a chat line at submit does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from schemas.chat import ChatMessage, NamedToolChoice, Tool
from schemas.request import MAX_SEED, SamplingParams, TokenId

Number = StrictFloat | StrictInt
# Sent by agent clients (the openai SDK, the Agents SDK, LangChain, verifiers) and meaningless
# for a rollout: accepted, ignored.
IGNORED_FIELDS = frozenset({
    "model", "user", "store", "metadata", "parallel_tool_calls", "service_tier", "stream_options",
    "prompt_cache_key", "safety_identifier", "reasoning_effort", "modalities", "verbosity",
    "return_tokens_as_token_ids",
})
DEFAULT_MAX_TOKENS = 1024


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: StrictStr | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    # SGLang's extras, in the body as its OpenAI server takes them.
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def budget(self) -> int | None:
        return self.max_tokens

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        """The SGLang sampling parameters of this body (OpenAI's defaults where it says nothing)."""
        values: dict[str, Any] = {
            "max_new_tokens": self.budget() or default_max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "n": self.n,
        }
        optional = {
            "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids, "top_k": self.top_k,
            "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim,
        }
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams.model_validate(values)


class ChatCompletionBody(_Body):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: StrictBool = True
    reasoning_effort: StrictStr | None = None
    modalities: list[StrictStr] | None = None
    verbosity: StrictStr | None = None

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_k(self) -> int:
        """What rows record: the chosen token's logprob always (trajectories need it), top-k if asked."""
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionBody(_Body):
    """`POST /v1/completions`: a text prompt, or token ids (one prompt; lists of prompts are refused)."""

    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @property
    def logprobs_k(self) -> int:
        return self.logprobs or 0
