"""Whether an engine can serve a request: the capability rules (`schemas.capabilities`) applied to
one request, with a hint saying how to start a worker that can. The worker checks every request of
a job before it runs; an engine that may be called without the worker checks too."""

from __future__ import annotations

from schemas.capabilities import SAMPLING_HINTS, missing, needs_of
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.errors import UnsupportedRequestError


def check_request_supported(request: RolloutRequest, capabilities: Capabilities) -> None:
    """Refuse what the worker cannot serve (the rules: `schemas.capabilities`), instead of silently
    dropping a field."""
    lacks = missing(needs_of(request), capabilities)
    if lacks:
        hints = [SAMPLING_HINTS[lack] for lack in lacks if lack in SAMPLING_HINTS]
        if request.logprobs and f"top-{request.logprobs} logprobs" in lacks:
            hints.insert(0, f"this worker allows at most {capabilities.max_top_logprobs}; start it with "
                            f"--max-top-logprobs {request.logprobs}")
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise UnsupportedRequestError(f"request {request.id!r}: this worker cannot serve {', '.join(lacks)}{hint}")
