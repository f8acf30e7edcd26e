"""The stop and logprob contracts, applied to whatever engine produced the output.

- finish_reason is OpenAI's: stop, length, abort.
- stop_reason_text / stop_reason_token hold the user's matched stop; a stop on the model's own
  EOS or hidden stop ids leaves both null unless the user listed that id.
- completion ids stay verbatim; a matched stop string is trimmed from the text only.
- len(completion_logprobs) == len(completion_token_ids), top-k lists sorted and k long,
  prompt logprobs one per prompt token with position 0 null.

An output that breaks an invariant raises `ContractViolation`; it never becomes a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from schemas.adapters import split_pinned
from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.errors import ContractViolation


@dataclass(frozen=True)
class StopOutcome:
    finish_reason: str
    stop_reason_text: str | None = None
    stop_reason_token: int | None = None


def resolve_finish(request: RolloutRequest, finish: Finish) -> StopOutcome:
    """Map an engine finish to the row's finish_reason and the user's matched stop."""
    params = request.sampling_params
    if finish.kind == "length":
        return StopOutcome("length")
    if finish.kind == "abort":
        return StopOutcome("abort")
    if finish.kind != "stop":
        raise ContractViolation(f"request {request.id!r}: unknown finish type {finish.kind!r}")
    matched = finish.matched
    if isinstance(matched, bool):
        raise ContractViolation(f"request {request.id!r}: finish matched a bool ({matched})")
    if isinstance(matched, int):
        # EOS, hidden stop ids and user stop ids arrive alike: tell them apart by the user's list.
        user_ids = () if params.ignore_eos else params.user_stop_token_ids
        return StopOutcome("stop", stop_reason_token=matched if matched in user_ids else None)
    if isinstance(matched, str):
        if matched not in params.stop_strings:
            raise ContractViolation(
                f"request {request.id!r}: engine stopped on string {matched!r}, "
                f"which is not one of the request's stops {list(params.stop_strings)}"
            )
        return StopOutcome("stop", stop_reason_text=matched)
    if matched is None:
        return StopOutcome("stop")
    raise ContractViolation(f"request {request.id!r}: finish matched {matched!r} of unknown type")


def trim_stop_text(text: str | None, stop_text: str | None, no_stop_trim: bool) -> str | None:
    """SGLang's `trim_matched_stop` for strings: cut before the matched stop string, or just
    after it with `no_stop_trim` (text decoded past the stop is never kept)."""
    if text is None or stop_text is None:
        return text
    cut = text.find(stop_text)
    if cut < 0:
        return text
    return text[: cut + len(stop_text)] if no_stop_trim else text[:cut]


def check_sample(request: RolloutRequest, sample: SampleOutput) -> None:
    """Raise `ContractViolation` unless the sample keeps every logprob invariant."""
    who = f"request {request.id!r}"
    n_tokens = len(sample.token_ids)
    if n_tokens > request.sampling_params.max_new_tokens:
        raise ContractViolation(
            f"{who}: {n_tokens} completion tokens exceed max_new_tokens "
            f"{request.sampling_params.max_new_tokens}"
        )
    if request.logprobs is not None:
        if sample.logprobs is None or len(sample.logprobs) != n_tokens:
            got = None if sample.logprobs is None else len(sample.logprobs)
            raise ContractViolation(f"{who}: {got} logprobs for {n_tokens} completion tokens")
        if n_tokens and not np.all(np.asarray(sample.logprobs) <= 1e-4):
            raise ContractViolation(f"{who}: a logprob is positive")
    k = request.logprobs or 0
    if k > 0:
        tops = sample.top_logprobs
        if tops is None or len(tops) != n_tokens:
            raise ContractViolation(f"{who}: top logprobs missing or not one per token")
        for position, alternatives in enumerate(tops):
            values = [lp for _, lp in alternatives]
            if len(alternatives) != k or values != sorted(values, reverse=True):
                raise ContractViolation(f"{who}: top logprobs at {position} not {k} sorted entries")
    if request.prompt_logprobs is not None:
        prompt = sample.prompt_logprobs
        if prompt is None or len(prompt) != len(request.input_ids) or prompt[0] is not None:
            raise ContractViolation(
                f"{who}: prompt logprobs must be one per prompt token with position 0 null"
            )


def token_version_segments(request: RolloutRequest, sample: SampleOutput, job_version: int) -> list[tuple[int, int]]:
    """The (start, version) runs of the sample's completion tokens, checked.

    A sample without segments came from one version: the engine's report, which must be the
    job's (in drain mode a batch never mixes versions). Segments (a sample continued across a
    partial swap, `workers.rows.continuation`) start at 0, ascend strictly within the completion,
    and consecutive versions differ.
    """
    who = f"request {request.id!r}"
    segments = sample.version_segments
    if segments is None:
        version = job_version if sample.weight_version is None else sample.weight_version
        if version != job_version:
            raise ContractViolation(
                f"{who}: engine reports weight version {version}, the worker serves {job_version}"
            )
        return [(0, version)]
    return checked_runs(who, "weight version", segments, len(sample.token_ids))


def token_adapter_segments(request: RolloutRequest, sample: SampleOutput) -> list[tuple[int, int]] | None:
    """The (start, version) runs of the LoRA adapter versions of the sample's completion tokens, checked;
    None on the base. A sample without them ran on the version its request was pinned to; one
    continued across a partial adapter push has them (`workers.rows.continuation`)."""
    if request.adapter is None:
        if sample.adapter_version_segments is not None:
            raise ContractViolation(f"request {request.id!r}: adapter version segments on a request without an "
                                    "adapter")
        return None
    segments = sample.adapter_version_segments
    if segments is None:
        version = split_pinned(request.adapter)[1]
        if version is None:
            raise ContractViolation(f"request {request.id!r}: adapter {request.adapter!r} was not pinned to a version "
                                    "before it ran (workers.jobs.adapters)")
        return [(0, version)]
    return checked_runs(f"request {request.id!r}", "adapter version", segments, len(sample.token_ids))


def checked_runs(who: str, what: str, segments: list[tuple[int, int]], n_tokens: int) -> list[tuple[int, int]]:
    """`segments` if they are runs over `n_tokens` starting at 0, ascending, versions changing."""
    starts = [start for start, _ in segments]
    versions = [version for _, version in segments]
    if (
        not segments or starts[0] != 0 or any(b <= a for a, b in pairwise(starts))
        or starts[-1] >= max(1, n_tokens) or any(v < 0 for v in versions)
        or any(a == b for a, b in pairwise(versions))
    ):
        raise ContractViolation(
            f"{who}: {what} segments {segments} do not cover {n_tokens} completion tokens as "
            "runs starting at 0 with ascending starts and changing versions"
        )
    return list(segments)
