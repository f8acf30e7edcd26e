"""Placing a submit's requests on the pool's live workers, so a mistake fails at submit.

Each request must be servable by at least one live worker of the pool on its own (a worker
having everything it asks, not the best of each capability across workers); otherwise the
submit is refused, naming the request and what is missing on every worker. Requests are then
packed into jobs by the set of worker classes that can serve them, so that no job mixes, say,
a request needing routed experts with one needing top-5 logprobs when no single worker has
both. With no live worker there is nothing to check against: requests asking for top-k
logprobs or routed experts (what typically differs between workers) get jobs of their own,
and the worker checks again (`workers.jobs.admission`). The rules are `schemas.capabilities`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from operator import attrgetter, methodcaller
from typing import Protocol, TypeVar

from pipeline.core.errors import CapabilityError
from schemas.capabilities import NO_NEEDS, SAMPLING_HINTS, Asks, Needs, describe, in_vocabulary, missing, needs_of
from schemas.request import SamplingParams
from schemas.worker_info import Capabilities, WorkerInfo

MAX_PROBLEMS = 20
_HINTS = {
    "routed experts": "routed experts need a mixture-of-experts model on an engine that captures routing",
    "stop strings (a tokenizer)": "stop strings need an engine with a tokenizer",
    **SAMPLING_HINTS,
}
# What the rules read of a request (its sampling parameters object: requests of one shape share it).
_ASKS = attrgetter("sampling_shape", "logprobs", "prompt_logprobs", "return_routed_experts")
_MAX_TOKEN_ID = methodcaller("max_token_id")


class Named(Asks, Protocol):
    """A request the rules read, with its id (`RolloutRequest`, `ParsedRequest`)."""

    id: str


R = TypeVar("R", bound=Named)


class Placement:
    """Where the requests of one submit can run among the pool's live workers."""

    def __init__(self, workers: Sequence[WorkerInfo], pool: str) -> None:
        self.pool = pool
        self.counts = Counter(w.capabilities for w in workers)
        self.classes: list[Capabilities] = list(self.counts)
        # Token ids are checked here only when some worker knows its vocabulary; a job's needs carry
        # its largest token id whatever the workers, for the worker's admission to check.
        self.token_ids = any(c.vocab_size is not None for c in self.classes)
        self.problems: list[str] = []
        # Per request shape (its sampling parameters object, kept alive here so that its id stays
        # its own, and the fields the rules read): its needs without token ids and the job key.
        self._shapes: dict[tuple[int, int | None, bool, bool], tuple[SamplingParams, Needs, Hashable]] = {}

    def place(self, request: Asks, request_id: str, row: int | None = None) -> tuple[Needs, Hashable]:
        """The request's needs, and the key of the jobs it may share (the classes that serve it);
        a problem names the request by its id (and `row`, its row in a table, when given).

        The rules run once per request shape (`ParsedRequest`s of one `sampling_params` shape share
        its parameters object); per request only the largest token id is read (and checked, when a
        worker knows its vocabulary)."""
        needs, key = self._shape(request)
        needs = needs.with_token_ids(request.max_token_id())
        if self.token_ids:
            key = tuple(i for i in key if in_vocabulary(needs.max_token_id, self.classes[i]))
        if self.classes and not key and len(self.problems) < MAX_PROBLEMS:
            where = "" if row is None else f" (row {row})"
            self.problems.append(self._explain(f"request {request_id!r}{where}", needs))
        return needs, key

    def place_block(self, requests: Sequence[R]) -> list[tuple[Hashable, Needs, list[R]]]:
        """`place` of each request (named by its id), grouped by job key, in order within each
        group; a group's needs are the union of its requests'.

        A block whose requests all ask alike (a file's usual case: one sampling shape) is placed
        once when every class that serves the shape knows its largest token id: per request, only
        what it asks and its largest token id are read."""
        asks = list(map(_ASKS, requests))
        if asks and asks.count(asks[0]) == len(asks):
            needs, key = self._shape(requests[0])
            needs = needs.with_token_ids(max(map(_MAX_TOKEN_ID, requests)))
            whole = not self.token_ids or all(in_vocabulary(needs.max_token_id, self.classes[i]) for i in key)
            if whole and (key or not self.classes):
                return [(key, needs, list(requests))]
        groups: dict[Hashable, list[R]] = {}
        union: dict[Hashable, Needs] = {}
        for request in requests:
            needs, key = self.place(request, request.id)
            groups.setdefault(key, []).append(request)
            union[key] = union.get(key, NO_NEEDS) | needs
        return [(key, union[key], members) for key, members in groups.items()]

    def job_needs(self, needs: Needs, requests: Iterable[Asks]) -> Needs:
        """`needs` (of a group some of whose requests make a job) with the largest token id of the
        job's `requests`: exactly what the job needs."""
        return needs.with_token_ids(max(map(_MAX_TOKEN_ID, requests)))

    def _shape(self, request: Asks) -> tuple[Needs, Hashable]:
        """The needs without token ids and the job key of the request's shape, worked out once."""
        params = request.sampling_shape
        shape = (id(params), request.logprobs, request.prompt_logprobs is not None, request.return_routed_experts)
        known = self._shapes.get(shape)
        if known is None:
            needs = needs_of(request, token_ids=False)
            if self.classes:
                key: Hashable = tuple(i for i, c in enumerate(self.classes) if not missing(needs, c))
            else:
                # Nothing known of the workers: keep apart what typically differs between them.
                key = (needs.top_logprobs > 0, needs.routed_experts)
            known = self._shapes[shape] = (params, needs, key)
        return known[1], known[2]

    def check(self) -> None:
        """`CapabilityError` listing the requests no live worker of the pool can serve."""
        if self.problems:
            raise CapabilityError("nothing was enqueued:\n  " + "\n  ".join(self.problems))

    def _explain(self, who: str, needs: Needs) -> str:
        lacks = [missing(needs, c) for c in self.classes]
        everywhere = [need for need in lacks[0] if all(need in other for other in lacks[1:])]
        if everywhere:
            hints = [_HINTS[need] for need in everywhere if need in _HINTS]
            if needs.top_logprobs and f"top-{needs.top_logprobs} logprobs" in everywhere:
                hints.append(f"start a worker with --max-top-logprobs {needs.top_logprobs}")
            return (f"{who}: no live worker of pool {self.pool!r} has {', '.join(everywhere)}"
                    + (f" ({'; '.join(hints)})" if hints else ""))
        each = "; ".join(f"{self.counts[c]} worker(s) [{describe(c)}] lack {', '.join(lack)}"
                         for c, lack in zip(self.classes, lacks, strict=True))
        return f"{who}: no single live worker of pool {self.pool!r} has all it asks ({each})"
