"""vLLM's OpenAI-compatible `/v1/completions`, both ways: a `RolloutRequest` to a token-id
completion request, and a completion response back to `SampleOutput`s.

Field names and shapes are vLLM 0.32's (`entrypoints/openai/completion/protocol.py`:
`CompletionRequest`, `CompletionResponseChoice`; `serving.py`: `_create_completion_logprobs`).
The prompt is sent as token ids with `return_token_ids`, so each choice carries its `token_ids`
verbatim (the stop or EOS token included) and the `prompt_token_ids` the server saw. Token
strings in `logprobs` are asked as `token_id:N` (`return_tokens_as_token_ids`), so top-k
alternatives name their token ids exactly.

Which requests a server serves exactly depends on its `--logprobs-mode` (`logprob_capabilities`,
the worker's capability check; `refusal` for the rest).

A response that breaks an invariant (lengths disagree, logprob tokens name other ids than
`token_ids`, an unknown finish, a missing field) raises `ContractViolation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.engines.seeds import plan_calls
from workers.errors import ContractViolation

# `--logprobs-mode` values (vllm/config/model.py: LogprobsMode).
RAW_LOGPROBS = "raw_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"
LOGPROBS_MODES = (RAW_LOGPROBS, PROCESSED_LOGPROBS, "raw_logits", "processed_logits")
TOKEN_ID_PREFIX = "token_id:"
# vLLM samples greedily below this temperature (vllm/sampling_params.py: _SAMPLING_EPS); SGLang below 1e-6.
VLLM_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class CompletionCall:
    """One `/v1/completions` call: its body and how many choices it returns."""

    request: RolloutRequest
    rid: str  # the body's `request_id`
    payload: dict[str, Any]
    samples: int  # choices in the answer: n for one call with n > 1, else 1
    first_sample: int = 0  # index of this call's first sample within the request
    drop_output: bool = False  # max_new_tokens 0: vLLM generates at least one token; it is dropped

    def with_rid(self, rid: str) -> CompletionCall:
        return CompletionCall(self.request, rid, {**self.payload, "request_id": rid}, self.samples,
                              self.first_sample, self.drop_output)

    @property
    def vllm_ids(self) -> list[str]:
        """The external id vLLM tracks this call under (`cmpl-{request_id}-{prompt index}`), which
        `/abort_requests` takes; an `n` call's samples are aborted with their parent."""
        return [f"cmpl-{self.rid}-0"]


# -- which requests a server serves exactly ------------------------------------------------


def logprob_capabilities(logprobs_mode: str) -> dict[str, bool]:
    """Which of `schemas.capabilities.SAMPLING_RULES` a vLLM server in `logprobs_mode` meets.

    The logprob contract is SGLang's: log-softmax of the penalised logits over the temperature,
    before top-k/top-p/min-p (plain log-softmax for greedy); prompt logprobs over the temperature
    too. vLLM's `raw_logprobs` (the default) are the log-softmax before penalties (and min_tokens'
    masking) and temperature, so before filtering too; `processed_logprobs` are after penalties,
    temperature and top-k/top-p/min-p filtering, which renormalises over the kept tokens; prompt
    logprobs are never tempered; vLLM's repetition penalty counts the prompt's tokens too
    (vllm/v1/sample/sampler.py, v1/sample/ops/topk_topp_sampler.py, v1/worker/gpu_model_runner.py:
    _get_prompt_logprobs_dict, model_executor/layers/utils.py: apply_penalties). The `*_logits`
    modes give no logprobs at all (`refusal`).
    """
    raw, processed = logprobs_mode == RAW_LOGPROBS, logprobs_mode == PROCESSED_LOGPROBS
    return {"tempered_logprobs": processed, "filtered_logprobs": raw, "penalised_logprobs": processed,
            "tempered_prompt_logprobs": False, "repetition_penalty": False}


def refusal(request: RolloutRequest, logprobs_mode: str) -> str | None:
    """Why a vLLM server in `logprobs_mode` cannot serve `request`, beyond what its capabilities
    say (`logprob_capabilities`, checked by the worker for every engine): logprobs from a server
    that returns logits, and a temperature vLLM decodes greedily but SGLang samples at."""
    params = request.sampling_params
    where = f"request {request.id!r}"
    if not params.greedy and params.temperature < VLLM_GREEDY_BELOW:
        return (f"{where}: temperature {params.temperature:g} samples under SGLang's rule (greedy below 1e-6) but "
                f"vLLM decodes greedily below {VLLM_GREEDY_BELOW:g}; use 0 for greedy or at least "
                f"{VLLM_GREEDY_BELOW:g}")
    if (request.logprobs is not None or request.prompt_logprobs is not None) \
            and logprobs_mode not in (RAW_LOGPROBS, PROCESSED_LOGPROBS):
        return (f"{where} asks for logprobs, but the vLLM server returns {logprobs_mode} (--logprobs-mode), "
                "not logprobs; restart it with --logprobs-mode processed_logprobs (or raw_logprobs), "
                "or ask for logprobs: null")
    return None


# -- requests -> calls -----------------------------------------------------------------------


def completion_payload(request: RolloutRequest, *, rid: str, n: int, seed: int | None) -> dict[str, Any]:
    """The `/v1/completions` body of one call. Every sampling field is sent explicitly, so the
    server's defaults (from the model's generation_config) never apply."""
    params = request.sampling_params
    body: dict[str, Any] = {
        "request_id": rid,
        "prompt": list(request.input_ids),
        "return_token_ids": True,
        "max_tokens": max(1, params.max_new_tokens),
        "min_tokens": params.min_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": 0 if params.top_k == -1 else params.top_k,  # vLLM: 0 disables
        "min_p": params.min_p,
        "n": n,
        "stop": list(params.stop_strings),
        "stop_token_ids": list(params.user_stop_token_ids),
        # SGLang's no_stop_trim: the text keeps the matched stop string (ids are verbatim either way).
        "include_stop_str_in_output": params.no_stop_trim,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    if request.adapter is not None:  # the pinned name the engine loaded it under (`NAME@vN`)
        body["model"] = request.adapter
    if seed is not None:
        body["seed"] = seed
    if request.logprobs is not None:
        body["logprobs"] = request.logprobs
        body["return_tokens_as_token_ids"] = True
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = 0  # the prompt token's own logprob (vLLM adds it to the top-0)
    return body


def completion_calls(request: RolloutRequest, *, rid_prefix: str | None = None) -> list[CompletionCall]:
    """The calls that produce all `n` samples of `request` (`seeds.plan_calls`: with a seed and
    n > 1, one call per sample under its own seed, as every engine draws them)."""
    return [
        CompletionCall(request, rid, completion_payload(request, rid=rid, n=n, seed=seed), n, first,
                       drop_output=request.sampling_params.max_new_tokens == 0)
        for rid, n, seed, first in plan_calls(request, rid_prefix=rid_prefix)
    ]


# -- responses -> SampleOutput ---------------------------------------------------------------


def _ids(value: Any, *, name: str, who: str) -> list[int]:
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in value):
        raise ContractViolation(f"{who}: {name} is missing or not a list of token ids (was return_token_ids sent?)")
    return value


def _number(value: Any, *, name: str, who: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ContractViolation(f"{who}: {name} is {value!r}, expected a number")
    return float(value)


def token_of(key: Any, *, name: str, who: str) -> int:
    """The id in a `token_id:N` token string (`return_tokens_as_token_ids`)."""
    if isinstance(key, str) and key.startswith(TOKEN_ID_PREFIX) and key[len(TOKEN_ID_PREFIX):].isdigit():
        return int(key[len(TOKEN_ID_PREFIX):])
    raise ContractViolation(
        f"{who}: {name} {key!r} is not a 'token_id:N' string (was return_tokens_as_token_ids sent?)")


def parse_finish(choice: dict[str, Any], tokens: Sequence[int], user_stop_ids: Sequence[int], *, who: str) -> Finish:
    """`finish_reason` and `stop_reason` -> `Finish`. vLLM names the matched stop string or stop
    token id in `stop_reason` and leaves it null for EOS; it checks EOS first, so a user stop id
    that is also the EOS comes back null: the last token names it then."""
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "length":
        return Finish("length")
    if reason == "abort":
        return Finish("abort", message="aborted by the vLLM server")
    if reason != "stop":
        raise ContractViolation(f"{who}: finish_reason {reason!r}, expected stop, length or abort")
    if stop is None:
        last = tokens[-1] if len(tokens) else None
        return Finish("stop", matched=last if last in user_stop_ids else None)
    if isinstance(stop, str) or (isinstance(stop, int) and not isinstance(stop, bool)):
        return Finish("stop", matched=stop)
    raise ContractViolation(f"{who}: stop_reason {stop!r}, expected a token id, a string or null")


def _completion_logprobs(choice: dict[str, Any], tokens: Sequence[int], k: int, *,
                         who: str) -> tuple[np.ndarray, list[list[tuple[int, float]]] | None]:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        raise ContractViolation(f"{who}: logprobs is {type(logprobs).__name__}, expected an object")
    values, names = logprobs.get("token_logprobs"), logprobs.get("tokens")
    if not isinstance(values, list) or not isinstance(names, list) or not len(values) == len(tokens) == len(names):
        raise ContractViolation(f"{who}: logprobs.token_logprobs/tokens do not match the {len(tokens)} token_ids")
    if [token_of(n, name="logprobs.tokens entry", who=who) for n in names] != list(tokens):
        raise ContractViolation(f"{who}: logprobs.tokens name other token ids than token_ids")
    chosen = np.asarray([_number(v, name=f"logprobs.token_logprobs[{i}]", who=who) for i, v in enumerate(values)],
                        dtype=np.float32)
    if not k:
        return chosen, None
    positions = logprobs.get("top_logprobs")
    if not isinstance(positions, list) or len(positions) != len(tokens):
        raise ContractViolation(f"{who}: logprobs.top_logprobs has no entry per token")
    tops = []
    for position, (alternatives, token) in enumerate(zip(positions, tokens, strict=True)):
        if not isinstance(alternatives, dict):
            raise ContractViolation(f"{who}: logprobs.top_logprobs[{position}] is not an object")
        entries = [(token_of(key, name=f"top_logprobs[{position}] key", who=who),
                    _number(value, name=f"top_logprobs[{position}] value", who=who))
                   for key, value in alternatives.items()]
        # vLLM lists the sampled token first, then the top k by rank; a sampled token outside the
        # top k makes k + 1 entries (serving.py: _create_completion_logprobs).
        if len(entries) == k + 1 and entries[0][0] == token:
            entries = entries[1:]
        if len(entries) != k:
            raise ContractViolation(f"{who}: logprobs.top_logprobs[{position}] has {len(entries)} alternatives, "
                                    f"expected {k}")
        tops.append(sorted(entries, key=lambda entry: -entry[1]))
    return chosen, tops


def _prompt_logprobs(choice: dict[str, Any], input_ids: Sequence[int], *, who: str) -> list[float | None]:
    """`prompt_logprobs`: null at position 0, then `{"<id>": {"logprob", "rank", ...}}` per position."""
    positions = choice.get("prompt_logprobs")
    if not isinstance(positions, list) or len(positions) != len(input_ids):
        got = len(positions) if isinstance(positions, list) else positions
        raise ContractViolation(f"{who}: prompt_logprobs has {got} positions for {len(input_ids)} prompt tokens")
    if positions[0] is not None:
        raise ContractViolation(f"{who}: prompt_logprobs[0] is not null")
    values: list[float | None] = [None]
    for position in range(1, len(input_ids)):
        entry = positions[position]
        found = entry.get(str(input_ids[position])) if isinstance(entry, dict) else None
        if not isinstance(found, dict):
            raise ContractViolation(f"{who}: prompt_logprobs[{position}] has no entry for prompt token "
                                    f"{input_ids[position]}")
        values.append(_number(found.get("logprob"), name=f"prompt_logprobs[{position}].logprob", who=who))
    return values


def parse_choice(call: CompletionCall, choice: Any, *, cached_tokens: int, who: str) -> SampleOutput:
    """One choice of a completion response -> `SampleOutput`."""
    request = call.request
    if not isinstance(choice, dict):
        raise ContractViolation(f"{who}: choice is not an object")
    if _ids(choice.get("prompt_token_ids"), name="prompt_token_ids", who=who) != list(request.input_ids):
        raise ContractViolation(f"{who}: the server's prompt_token_ids differ from the request's input_ids")
    tokens = _ids(choice.get("token_ids"), name="token_ids", who=who)
    text = choice.get("text")
    if not isinstance(text, str):
        raise ContractViolation(f"{who}: text is {type(text).__name__}, expected a string")
    if call.drop_output:  # max_new_tokens 0: nothing is generated
        return SampleOutput(token_ids=np.zeros(0, dtype=np.int32), finish=Finish("length"), text="",
                            logprobs=None if request.logprobs is None else np.zeros(0, dtype=np.float32),
                            top_logprobs=[] if request.logprobs else None,
                            prompt_logprobs=None if request.prompt_logprobs is None
                            else _prompt_logprobs(choice, request.input_ids, who=who),
                            cached_tokens=cached_tokens)
    sample = SampleOutput(
        token_ids=np.asarray(tokens, dtype=np.int32),
        finish=parse_finish(choice, tokens, request.sampling_params.user_stop_token_ids, who=who),
        text=text,
        cached_tokens=cached_tokens,
    )
    if request.logprobs is not None:
        sample.logprobs, sample.top_logprobs = _completion_logprobs(choice, tokens, request.logprobs, who=who)
    if request.prompt_logprobs is not None:
        sample.prompt_logprobs = _prompt_logprobs(choice, request.input_ids, who=who)
    return sample


def _cached_tokens(body: dict[str, Any]) -> int:
    """`usage.prompt_tokens_details.cached_tokens` (served with --enable-prompt-tokens-details), else 0."""
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else 0


def parse_completion(call: CompletionCall, body: Any) -> list[SampleOutput]:
    """The answer to one call: `samples` choices, in `index` order."""
    who = f"request {call.request.id!r} (request_id {call.rid})"
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != call.samples:
        got = len(choices) if isinstance(choices, list) else "no"
        raise ContractViolation(f"{who}: {got} choices for {call.samples} samples")
    if sorted(c.get("index") if isinstance(c, dict) else None for c in choices) != list(range(call.samples)):
        raise ContractViolation(f"{who}: choice indexes are not 0..{call.samples - 1}")
    cached = _cached_tokens(body)
    ordered = sorted(choices, key=lambda c: c["index"])
    return [parse_choice(call, choice, cached_tokens=cached, who=f"{who} sample {call.first_sample + i}")
            for i, choice in enumerate(ordered)]


# -- streamed calls (agent turns with `stream: true`) ------------------------------------------

_LOGPROB_LISTS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def streamable(call: CompletionCall) -> bool:
    """Whether a call's answer can be assembled from vLLM's stream: its chunks carry no
    `prompt_logprobs` (vLLM 0.32 sends them only without `stream`)."""
    return call.samples == 1 and not call.drop_output and call.request.prompt_logprobs is None


class DeltaChunks:
    """vLLM's streamed `/v1/completions`, assembled into the body a non-streamed call gets: each
    chunk's choice carries what is new (`text`, `token_ids`, `logprobs` lists), the first its
    `prompt_token_ids`, the last its `finish_reason` and `stop_reason`; a last chunk without choices
    the `usage` (asked for with `stream_options`). Checked as any answer when parsed."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {"stream_options": {"include_usage": True}}
        self.head: dict[str, Any] = {}
        self.choices: dict[Any, dict[str, Any]] = {}
        self.usage: Any = None

    def take(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            raise ContractViolation(f"a streamed chunk is {type(chunk).__name__}, expected an object")
        if not self.head:
            self.head = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                raise ContractViolation("a streamed choice is not an object")
            into = self.choices.setdefault(choice.get("index"), {
                "index": choice.get("index"), "text": "", "token_ids": [], "logprobs": None,
                "finish_reason": None, "stop_reason": None, "prompt_token_ids": None})
            into["text"] += choice.get("text") or ""
            into["token_ids"] += choice.get("token_ids") or []
            if choice.get("prompt_token_ids") is not None:
                into["prompt_token_ids"] = choice["prompt_token_ids"]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                merged = into["logprobs"] = into["logprobs"] or {key: [] for key in _LOGPROB_LISTS}
                for key in _LOGPROB_LISTS:
                    merged[key] += logprobs.get(key) or []
            if choice.get("finish_reason") is not None:
                into["finish_reason"], into["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")

    def so_far(self) -> list[int]:
        first = self.choices.get(0)
        return [] if first is None else list(first["token_ids"])

    def answer(self) -> dict[str, Any]:
        return {**self.head, "choices": [self.choices[k] for k in sorted(self.choices, key=str)], "usage": self.usage}
