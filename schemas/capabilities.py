"""Whether a worker can serve a request: the one set of rules, used by submit
(`pipeline.submit.placement`, against each live worker of the pool) and by the worker
(`workers.rows.contracts`, `workers.jobs.admission`, against its own capabilities).

A request's `Needs` are what it asks of a worker: top-k logprobs, prompt logprobs, routed
experts, a tokenizer (for stop strings), token ids inside the vocabulary, and logprobs under
sampling settings not every engine reports exactly (`SAMPLING_RULES`: vLLM's logprobs depend on
its --logprobs-mode). A job needs the union
of its requests' needs, so one worker serves a job only if it serves every request in it.
`missing(needs, capabilities)` names each need the worker lacks, in words that are the same
for every worker, so the needs missing on every worker of a pool are their intersection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from schemas.request import SamplingParams
from schemas.worker_info import Capabilities


class Asks(Protocol):
    """What the rules read of a request (`RolloutRequest`, or a parsed line at submit)."""

    logprobs: int | None
    return_routed_experts: bool

    @property
    def prompt_logprobs(self) -> int | None: ...

    @property
    def stop_strings(self) -> tuple[str, ...]: ...

    @property
    def sampling_shape(self) -> SamplingParams:
        """The sampling parameters; the seed may be left out (no rule reads it)."""
        ...

    def max_token_id(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Needs:
    """What a request (or a job: the union of its requests') asks of the worker serving it."""

    top_logprobs: int = 0
    prompt_logprobs: bool = False
    routed_experts: bool = False
    stop_strings: bool = False
    max_token_id: int = -1  # -1: not checked
    # The sampling rules (`SAMPLING_RULES`), named as the `Capabilities` that meet them.
    tempered_logprobs: bool = False
    filtered_logprobs: bool = False
    penalised_logprobs: bool = False
    tempered_prompt_logprobs: bool = False
    repetition_penalty: bool = False

    def __or__(self, other: Needs) -> Needs:
        """What a job of both needs: the larger of the numbers, either of the flags. Paid per request
        where a submit's requests ask differently, so spelled out (a loop over `fields` cost ~10 µs);
        `self` when the other side is `self` or `NO_NEEDS` (tested by identity: `==` builds tuples)."""
        if other is self or other is NO_NEEDS:
            return self
        if self is NO_NEEDS:
            return other
        return Needs(
            top_logprobs=max(self.top_logprobs, other.top_logprobs),
            prompt_logprobs=self.prompt_logprobs or other.prompt_logprobs,
            routed_experts=self.routed_experts or other.routed_experts,
            stop_strings=self.stop_strings or other.stop_strings,
            max_token_id=max(self.max_token_id, other.max_token_id),
            tempered_logprobs=self.tempered_logprobs or other.tempered_logprobs,
            filtered_logprobs=self.filtered_logprobs or other.filtered_logprobs,
            penalised_logprobs=self.penalised_logprobs or other.penalised_logprobs,
            tempered_prompt_logprobs=self.tempered_prompt_logprobs or other.tempered_prompt_logprobs,
            repetition_penalty=self.repetition_penalty or other.repetition_penalty,
        )

    def with_token_ids(self, max_token_id: int) -> Needs:
        return replace(self, max_token_id=max_token_id)

    def as_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults, which `from_dict` reads back as they were: a
        job's meta carries only what it needs (`{}` for a job that needs nothing special)."""
        return {name: value for name, default in _DEFAULTS.items() if (value := getattr(self, name)) != default}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> Needs:
        """The needs a submit stored with a job; `ValueError` for anything else."""
        if not isinstance(value, Mapping) or set(value) - set(cls.__slots__):
            raise ValueError(f"not a job's needs: {value!r}")
        fields = {}
        for name, default in asdict(cls()).items():
            given = value.get(name, default)
            if type(given) is not type(default):
                raise ValueError(f"needs.{name}: {given!r} is not a {type(default).__name__}")
            fields[name] = given
        return cls(**fields)


NO_NEEDS = Needs()
_DEFAULTS = asdict(NO_NEEDS)


# Needs an engine may not meet exactly (the name is both the `Needs` and the `Capabilities`
# field): what a refusal says, and what to do about it.
SAMPLING_RULES: dict[str, tuple[str, str]] = {
    "tempered_logprobs": (
        "logprobs at a temperature other than 0 or 1",
        "a vLLM server gives them with --logprobs-mode processed_logprobs (its default, raw_logprobs, ignores "
        "the temperature); or sample at temperature 1",
    ),
    "filtered_logprobs": (
        "logprobs of top-k/top-p/min-p filtered sampling",
        "vLLM's processed_logprobs renormalise them over the tokens the filter keeps; a raw_logprobs vLLM server "
        "gives them at temperature 1, or drop the filter",
    ),
    "penalised_logprobs": (
        "logprobs with frequency/presence penalties or min_new_tokens",
        "a vLLM server gives them with --logprobs-mode processed_logprobs (raw_logprobs are taken before "
        "penalties)",
    ),
    "tempered_prompt_logprobs": (
        "prompt logprobs at a temperature other than 0 or 1",
        "vLLM never divides prompt logprobs by the temperature; ask for them at temperature 1 or 0",
    ),
    "repetition_penalty": (
        "repetition_penalty (over generated tokens only, as SGLang)",
        "vLLM's repetition penalty also counts the prompt's tokens; use frequency/presence penalties",
    ),
}
SAMPLING_HINTS = dict(SAMPLING_RULES.values())


def sampling_needs(params: SamplingParams, logprobs: int | None, prompt_logprobs: int | None) -> dict[str, bool]:
    """The `SAMPLING_RULES` a request with these parameters needs met. Greedy requests (plain
    log-softmax) need none of the temperature or filter rules."""
    sampled = not params.greedy
    tempered = sampled and params.temperature != 1.0
    return {
        "tempered_logprobs": logprobs is not None and tempered,
        "filtered_logprobs": logprobs is not None and sampled
        and (params.top_k != -1 or params.top_p < 1.0 or params.min_p > 0.0),
        "penalised_logprobs": logprobs is not None
        and bool(params.frequency_penalty or params.presence_penalty or params.min_new_tokens),
        "tempered_prompt_logprobs": prompt_logprobs is not None and tempered,
        "repetition_penalty": params.repetition_penalty != 1.0,
    }


def needs_of(request: Asks, *, token_ids: bool = True) -> Needs:
    """What `request` asks of a worker (`token_ids=False` leaves the vocabulary unchecked)."""
    return Needs(
        top_logprobs=request.logprobs or 0,
        prompt_logprobs=request.prompt_logprobs is not None,
        routed_experts=request.return_routed_experts,
        stop_strings=bool(request.stop_strings),
        max_token_id=request.max_token_id() if token_ids else -1,
        **sampling_needs(request.sampling_shape, request.logprobs, request.prompt_logprobs),
    )


def job_needs(requests: Iterable[Asks], *, token_ids: bool = True) -> Needs:
    """The union of the requests' needs: what the one worker serving their job must have."""
    needs = Needs()
    for request in requests:
        needs |= needs_of(request, token_ids=token_ids)
    return needs


def in_vocabulary(max_token_id: int, capabilities: Capabilities) -> bool:
    """Whether token ids up to `max_token_id` (-1: not checked) are in the worker's vocabulary (if it knows it)."""
    return capabilities.vocab_size is None or max_token_id < capabilities.vocab_size


def missing(needs: Needs, capabilities: Capabilities) -> list[str]:
    """Each need `capabilities` does not meet, in words independent of the worker (empty: it serves them)."""
    lacks: list[str] = []
    if needs.top_logprobs > capabilities.max_top_logprobs:
        lacks.append(f"top-{needs.top_logprobs} logprobs")
    if needs.prompt_logprobs and not capabilities.prompt_logprobs:
        lacks.append("prompt logprobs")
    if needs.routed_experts and not capabilities.routed_experts:
        lacks.append("routed experts")
    if needs.stop_strings and not capabilities.stop_strings:
        lacks.append("stop strings (a tokenizer)")
    if not in_vocabulary(needs.max_token_id, capabilities):
        lacks.append(f"token id {needs.max_token_id} in its vocabulary")
    lacks.extend(words for name, (words, _) in SAMPLING_RULES.items()
                 if getattr(needs, name) and not getattr(capabilities, name))
    return lacks


def hints(lacks: list[str], needs: Needs) -> list[str]:
    """How to start a worker that meets each need in `lacks` (from `missing`), where there is a way."""
    found = [SAMPLING_HINTS[lack] for lack in lacks if lack in SAMPLING_HINTS]
    if f"top-{needs.top_logprobs} logprobs" in lacks:
        found.insert(0, f"start a worker with --max-top-logprobs {needs.top_logprobs}")
    return found


def explain(lacks: list[str], needs: Needs) -> str:
    """`lacks` in words, with `hints` in parentheses."""
    found = hints(lacks, needs)
    return ", ".join(lacks) + (f" ({'; '.join(found)})" if found else "")


def describe(capabilities: Capabilities) -> str:
    """A capability class in words, for status: what a worker of that class serves."""
    parts = [f"top-{capabilities.max_top_logprobs} logprobs" if capabilities.max_top_logprobs else "no top-k logprobs"]
    parts.append("routed experts" if capabilities.routed_experts else "no routed experts")
    if not capabilities.prompt_logprobs:
        parts.append("no prompt logprobs")
    if not capabilities.stop_strings:
        parts.append("no stop strings")
    if capabilities.vocab_size is not None:
        parts.append(f"vocab {capabilities.vocab_size}")
    if capabilities.lora_adapters:
        parts.append("LoRA adapters")
    parts.extend(f"no {words}" for name, (words, _) in SAMPLING_RULES.items() if not getattr(capabilities, name))
    return ", ".join(parts)
