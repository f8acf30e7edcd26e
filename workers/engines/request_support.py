"""Whether an engine can serve a request: the capability rules (`schemas.capabilities`) applied to
one request, with a hint saying how to start a worker that can. A worker checks what each job needs
once, when it admits it (`workers.jobs.admission`); an engine whose `generate` is also called without
a worker (vLLM's, whose answers would otherwise be silently inexact) checks each request itself."""

from __future__ import annotations

from schemas.capabilities import explain, missing, needs_of
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.errors import UnsupportedRequestError


def check_request_supported(request: RolloutRequest, capabilities: Capabilities) -> None:
    """Refuse what the worker cannot serve (the rules: `schemas.capabilities`), instead of silently
    dropping a field."""
    needs = needs_of(request)
    lacks = missing(needs, capabilities)
    if lacks:
        raise UnsupportedRequestError(f"request {request.id!r}: this engine cannot serve {explain(lacks, needs)}")
