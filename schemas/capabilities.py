"""Whether a worker can serve a request: the one set of rules, used by submit
(`pipeline.capabilities`, against each live worker of the pool) and by the worker
(`workers.contracts`, `workers.routing`, against its own capabilities).

A request's `Needs` are what it asks of a worker: top-k logprobs, prompt logprobs, routed
experts, a tokenizer (for stop strings), token ids inside the vocabulary. A job needs the union
of its requests' needs, so one worker serves a job only if it serves every request in it.
`missing(needs, capabilities)` names each need the worker lacks, in words that are the same
for every worker, so the needs missing on every worker of a pool are their intersection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from schemas.worker_info import Capabilities


class Asks(Protocol):
    """What the rules read of a request (`RolloutRequest`, or a parsed line at submit)."""

    logprobs: int | None
    return_routed_experts: bool

    @property
    def prompt_logprobs(self) -> int | None: ...

    @property
    def stop_strings(self) -> tuple[str, ...]: ...

    def max_token_id(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Needs:
    """What a request (or a job: the union of its requests') asks of the worker serving it."""

    top_logprobs: int = 0
    prompt_logprobs: bool = False
    routed_experts: bool = False
    stop_strings: bool = False
    max_token_id: int = -1  # -1: not checked

    def __or__(self, other: Needs) -> Needs:
        return Needs(
            top_logprobs=max(self.top_logprobs, other.top_logprobs),
            prompt_logprobs=self.prompt_logprobs or other.prompt_logprobs,
            routed_experts=self.routed_experts or other.routed_experts,
            stop_strings=self.stop_strings or other.stop_strings,
            max_token_id=max(self.max_token_id, other.max_token_id),
        )

    def without_token_ids(self) -> Needs:
        return replace(self, max_token_id=-1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

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


def needs_of(request: Asks, *, token_ids: bool = True) -> Needs:
    """What `request` asks of a worker (`token_ids=False` leaves the vocabulary unchecked)."""
    return Needs(
        top_logprobs=request.logprobs or 0,
        prompt_logprobs=request.prompt_logprobs is not None,
        routed_experts=request.return_routed_experts,
        stop_strings=bool(request.stop_strings),
        max_token_id=request.max_token_id() if token_ids else -1,
    )


def job_needs(requests: Iterable[Asks], *, token_ids: bool = True) -> Needs:
    """The union of the requests' needs: what the one worker serving their job must have."""
    needs = Needs()
    for request in requests:
        needs |= needs_of(request, token_ids=token_ids)
    return needs


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
    vocab = capabilities.vocab_size
    if vocab is not None and needs.max_token_id >= vocab:
        lacks.append(f"token id {needs.max_token_id} in its vocabulary")
    return lacks


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
    return ", ".join(parts)
