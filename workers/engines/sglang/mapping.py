"""SGLang's native protocol, both ways: a `RolloutRequest` to `GenerateReqInput` fields, and a
`/generate` result (or `Engine.async_generate` dict) back to `SampleOutput`s.

Shared by the HTTP adapter (`sglang_http`) and the in-process one (`sglang_engine`): the JSON
body of `POST /generate` and the keyword arguments of `async_generate` use the same names
(`managers/io_struct.py: GenerateReqInput`, `sampling/sampling_params.py`).

A result that breaks an invariant (lengths disagree, ids in the logprob triples differ from
`output_ids`, an unknown finish type, a missing field) raises `ContractViolation`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.request import RolloutRequest, SamplingParams
from workers.engines.base import Finish, SampleOutput
from workers.engines.http.backends import parse_weight_version
from workers.engines.seeds import plan_calls
from workers.engines.sglang.expert_ids import ExpertsLayout, decode_routed_experts, expected_rows
from workers.errors import ContractViolation


@dataclass(frozen=True)
class GenerateCall:
    """One `/generate` call: its body and how many results it returns."""

    request: RolloutRequest
    rid: str
    payload: dict[str, Any]  # GenerateReqInput fields, `rid` included
    samples: int  # results in the answer: n for one call with n > 1, else 1
    first_sample: int = 0  # index of this call's first sample within the request

    def with_rid(self, rid: str) -> GenerateCall:
        return GenerateCall(self.request, rid, {**self.payload, "rid": rid}, self.samples, self.first_sample)

    @property
    def sglang_rids(self) -> list[str]:
        """The ids SGLang tracks this call under (a batch expands `rid` to `{rid}_{i}`)."""
        return [self.rid] if self.samples == 1 else [f"{self.rid}_{i}" for i in range(self.samples)]


def sampling_params_payload(params: SamplingParams, *, n: int, seed: int | None) -> dict[str, Any]:
    """SGLang's `sampling_params` dict: token-id stops as `stop_token_ids`, seed as `sampling_seed`."""
    payload: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "n": n,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": params.no_stop_trim,
        "skip_special_tokens": params.skip_special_tokens,
        "min_new_tokens": params.min_new_tokens,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.stop_strings:
        payload["stop"] = list(params.stop_strings)
    if params.user_stop_token_ids:
        payload["stop_token_ids"] = list(params.user_stop_token_ids)
    if seed is not None:
        payload["sampling_seed"] = seed
    return payload


def generate_calls(request: RolloutRequest, *, rid_prefix: str | None = None) -> list[GenerateCall]:
    """The `/generate` calls that produce all `n` samples of `request` (`seeds.plan_calls`)."""
    common: dict[str, Any] = {"input_ids": list(request.input_ids)}
    if request.logprobs is not None or request.prompt_logprobs is not None:
        common["return_logprob"] = True
        common["top_logprobs_num"] = request.logprobs or 0
        common["logprob_start_len"] = 0 if request.prompt_logprobs is not None else -1
    if request.return_routed_experts:
        common["return_routed_experts"] = True
        common["routed_experts_start_len"] = 0
    if request.adapter is not None:  # the pinned name the engine loaded it under (`NAME@vN`)
        common["lora_path"] = request.adapter
    params = request.sampling_params
    calls = []
    for rid, n, seed, first in plan_calls(request, rid_prefix=rid_prefix):
        payload = {"rid": rid, **common, "sampling_params": sampling_params_payload(params, n=n, seed=seed)}
        calls.append(GenerateCall(request, rid, payload, n, first))
    return calls


# -- results -> SampleOutput -------------------------------------------------------------------


def parse_finish(value: Any, *, who: str) -> Finish:
    """`meta_info.finish_reason` -> `Finish`; SGLang's shapes from `managers/schedule_batch.py`."""
    if not isinstance(value, dict):
        raise ContractViolation(f"{who}: finish_reason is {value!r}, expected an object (is the result final?)")
    kind = value.get("type")
    if kind == "stop":
        matched = value.get("matched")
        if matched is None or isinstance(matched, str) or (isinstance(matched, int) and not isinstance(matched, bool)):
            return Finish("stop", matched=matched)
        raise ContractViolation(f"{who}: finish_reason matched {matched!r}, expected a token id or a string")
    if kind == "length":
        return Finish("length")
    if kind == "abort":
        message = value.get("message")
        return Finish("abort", message=None if message is None else str(message))
    raise ContractViolation(f"{who}: unknown finish_reason type {kind!r}")


def _triples(value: Any, *, name: str, who: str) -> list[tuple[float | None, int]]:
    """`[[logprob, token_id, text], ...]` -> [(logprob, token_id)]."""
    if not isinstance(value, list):
        raise ContractViolation(f"{who}: {name} is {type(value).__name__}, expected a list")
    out: list[tuple[float | None, int]] = []
    for position, entry in enumerate(value):
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise ContractViolation(f"{who}: {name}[{position}] is {entry!r}, expected [logprob, token_id, text]")
        logprob, token = entry[0], entry[1]
        if not isinstance(token, int) or isinstance(token, bool):
            raise ContractViolation(f"{who}: {name}[{position}] token id {token!r} is not an integer")
        if logprob is not None and (isinstance(logprob, bool) or not isinstance(logprob, int | float)):
            raise ContractViolation(f"{who}: {name}[{position}] logprob {logprob!r} is not a number")
        out.append((None if logprob is None else float(logprob), token))
    return out


def _token_ids(value: Any, *, who: str) -> np.ndarray:
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in value):
        raise ContractViolation(f"{who}: output_ids is missing or not a list of token ids")
    return np.asarray(value, dtype=np.int32)


def _completion_logprobs(meta: dict[str, Any], tokens: np.ndarray, *, who: str) -> np.ndarray:
    triples = _triples(meta.get("output_token_logprobs"), name="output_token_logprobs", who=who)
    if len(triples) != len(tokens):
        raise ContractViolation(f"{who}: {len(triples)} output_token_logprobs for {len(tokens)} output_ids")
    if [t for _, t in triples] != tokens.tolist():
        raise ContractViolation(f"{who}: output_token_logprobs name other token ids than output_ids")
    if any(lp is None for lp, _ in triples):
        raise ContractViolation(f"{who}: an output token has a null logprob")
    return np.asarray([lp for lp, _ in triples], dtype=np.float32)


def _top_logprobs(meta: dict[str, Any], n_tokens: int, k: int, *, who: str) -> list[list[tuple[int, float]]]:
    positions = meta.get("output_top_logprobs")
    if not isinstance(positions, list) or len(positions) != n_tokens:
        got = len(positions) if isinstance(positions, list) else positions
        raise ContractViolation(f"{who}: output_top_logprobs has {got} positions for {n_tokens} output_ids")
    tops: list[list[tuple[int, float]]] = []
    for position, alternatives in enumerate(positions):
        triples = _triples(alternatives, name=f"output_top_logprobs[{position}]", who=who)
        if len(triples) != k or any(lp is None for lp, _ in triples):
            raise ContractViolation(f"{who}: output_top_logprobs[{position}] has not {k} alternatives")
        tops.append([(token, float(lp)) for lp, token in triples])  # type: ignore[arg-type]
    return tops


def _prompt_logprobs(meta: dict[str, Any], input_ids: Sequence[int], *, who: str) -> list[float | None]:
    triples = _triples(meta.get("input_token_logprobs"), name="input_token_logprobs", who=who)
    if len(triples) != len(input_ids):
        raise ContractViolation(f"{who}: {len(triples)} input_token_logprobs for {len(input_ids)} prompt tokens")
    if [t for _, t in triples] != list(input_ids):
        raise ContractViolation(f"{who}: input_token_logprobs name other token ids than the prompt")
    if triples[0][0] is not None or any(lp is None for lp, _ in triples[1:]):
        raise ContractViolation(f"{who}: input_token_logprobs must be null at position 0 only")
    return [lp for lp, _ in triples]


def _count(meta: dict[str, Any], key: str, *, who: str) -> int:
    value = meta.get(key, 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ContractViolation(f"{who}: meta_info.{key} is {value!r}, expected a count")
    return value


def parse_result(request: RolloutRequest, result: Any, *, layout: ExpertsLayout | None, who: str,
                 gateway: str | None = None) -> SampleOutput:
    """One `{"text", "output_ids", "meta_info"}` result -> `SampleOutput`; `gateway`: the gateway
    or router it came through, if any."""
    if not isinstance(result, dict) or not isinstance(result.get("meta_info"), dict):
        raise ContractViolation(f"{who}: result is not an object with meta_info")
    meta: dict[str, Any] = result["meta_info"]
    tokens = _token_ids(result.get("output_ids"), who=who)
    finish = parse_finish(meta.get("finish_reason"), who=who)
    text = result.get("text")
    if text is not None and not isinstance(text, str):
        raise ContractViolation(f"{who}: text is {type(text).__name__}, expected a string")
    sample = SampleOutput(
        token_ids=tokens,
        finish=finish,
        text=text,
        cached_tokens=_count(meta, "cached_tokens", who=who),
        weight_version=parse_weight_version(meta.get("weight_version")),
    )
    if request.logprobs is not None:
        sample.logprobs = _completion_logprobs(meta, tokens, who=who)
    if request.logprobs:
        sample.top_logprobs = _top_logprobs(meta, len(tokens), request.logprobs, who=who)
    if request.prompt_logprobs is not None:
        sample.prompt_logprobs = _prompt_logprobs(meta, request.input_ids, who=who)
    if request.return_routed_experts:
        if meta.get("routed_experts") is None:
            raise ContractViolation(f"{who}: {_no_routed_experts(gateway)}")
        if layout is None:
            raise ContractViolation(f"{who}: routed experts returned but the expert layout is unknown")
        rows = expected_rows(len(request.input_ids), len(tokens), 0)
        sample.routed_experts = decode_routed_experts(meta["routed_experts"], rows, layout, who=who)
        sample.routed_experts_start = 0
    return sample


def _no_routed_experts(gateway: str | None) -> str:
    """Why a result asked for routed experts has none, most likely cause first."""
    if gateway is None:
        return ("no routed_experts in the result although the request asked for them; start the SGLang server "
                "with --enable-return-routed-experts (or, if a router sits in between, see that it forwards "
                "return_routed_experts)")
    return (f"no routed_experts in the result that came through the gateway {gateway} although the request "
            "asked for them: most likely the gateway dropped return_routed_experts from the request it "
            "forwarded (sglang-router 0.3.2 does; use smg >= 1.13.0, or give the servers' own URLs), "
            "or the SGLang servers were started without --enable-return-routed-experts")


def parse_call_results(call: GenerateCall, body: Any, *, layout: ExpertsLayout | None,
                       gateway: str | None = None) -> list[SampleOutput]:
    """The answer to one call (a dict for one result, a list of `samples` for n > 1); `gateway`:
    the gateway or router it came through, if any."""
    who = f"request {call.request.id!r} (rid {call.rid})"
    results = body if isinstance(body, list) else [body]
    if len(results) != call.samples:
        raise ContractViolation(f"{who}: {len(results)} results for {call.samples} samples")
    return [parse_result(call.request, r, layout=layout, who=f"{who} sample {call.first_sample + i}", gateway=gateway)
            for i, r in enumerate(results)]
