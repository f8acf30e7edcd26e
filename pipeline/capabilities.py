"""Checking requests against what the live workers can serve, so a mistake fails at submit."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import CapabilityError
from schemas.request import RolloutRequest
from schemas.worker_info import WorkerInfo


def check_requests(requests: Sequence[RolloutRequest], workers: Sequence[WorkerInfo]) -> None:
    """Raise `CapabilityError` when no live worker can serve some request.

    With no live worker there is nothing to check against: the worker checks again and
    fails the job with a clear error.
    """
    if not workers:
        return
    max_top = max(w.capabilities.max_top_logprobs for w in workers)
    routed = any(w.capabilities.routed_experts for w in workers)
    vocab_sizes = [w.capabilities.vocab_size for w in workers if w.capabilities.vocab_size]
    vocab = max(vocab_sizes) if vocab_sizes else None
    problems: list[str] = []
    for request in requests:
        asked = request.logprobs or 0
        if asked > max_top:
            problems.append(
                f"request {request.id!r}: asks for top-{asked} logprobs but the live workers "
                f"allow at most {max_top} (start a worker with --max-top-logprobs {asked})"
            )
        if request.return_routed_experts and not routed:
            problems.append(
                f"request {request.id!r}: return_routed_experts needs a mixture-of-experts model "
                "on an engine that captures routing; no live worker has it"
            )
        if vocab is not None and request.max_token_id() >= vocab:
            problems.append(
                f"request {request.id!r}: token id {request.max_token_id()} is outside the "
                f"live workers' vocabulary of {vocab}"
            )
        if len(problems) >= 20:
            break
    if problems:
        raise CapabilityError("nothing was enqueued:\n  " + "\n  ".join(problems))
