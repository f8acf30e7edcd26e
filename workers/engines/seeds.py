"""Per-sample seeds: sample i of a request with seed s draws from its own seed, on every engine.

SGLang gives all samples of an `n > 1` request the same `sampling_seed` (identical samples),
so engines derive one seed per sample from (seed, sample index) the same way. A sample continued
after a partial weight swap draws from a seed derived from (seed, sample index, tokens generated
before), so each continuation is reproducible and distinct from the sample's own start.

`plan_calls` splits a request into the server calls of the HTTP and in-process adapters that way.
"""

from __future__ import annotations

import os
import uuid
from typing import NamedTuple

from schemas.request import MAX_SEED, RolloutRequest
from workers.engines.base import ContinuedRequest


def sample_seed(seed: int | None, sample_index: int) -> int:
    """The seed of one sample; a fresh random one when the request has no seed."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & MAX_SEED
    return (seed * 1_000_003 + sample_index) % MAX_SEED


def continuation_seed(seed: int | None, sample_index: int, generated: int) -> int:
    """The seed of sample `sample_index` resumed after `generated` tokens (random without a seed)."""
    if seed is None:
        return sample_seed(None, 0)
    return sample_seed(sample_seed(seed, sample_index), generated + 1)


def request_sample_seed(request: RolloutRequest, sample_index: int) -> int:
    """The seed of sample `sample_index` of `request`, or of the one sample a continuation carries."""
    seed = request.sampling_params.seed
    if isinstance(request, ContinuedRequest):
        return continuation_seed(seed, request.sample_index, request.generated)
    return sample_seed(seed, sample_index)


class PlannedCall(NamedTuple):
    """One server call of a request: its id, how many samples, their seed, the first one's index."""

    rid: str
    n: int
    seed: int | None
    first_sample: int


def plan_calls(request: RolloutRequest, *, rid_prefix: str | None = None) -> list[PlannedCall]:
    """The calls that produce all `n` samples of `request`.

    Without a seed, one call with the server's own `n`. With a seed and n > 1, one call per
    sample, each seeded like the hf engine does (`seed`, sample index): SGLang gives every sample
    of an `n` request the same seed, so they would all be the same sample. A continuation is one
    sample under its continuation seed; its id says so: `{id}+{tokens before}-...`.
    """
    params = request.sampling_params
    continued = isinstance(request, ContinuedRequest)
    suffix = f"+{request.generated}" if isinstance(request, ContinuedRequest) else ""
    base = rid_prefix or f"{request.id}{suffix}-{uuid.uuid4().hex[:16]}"
    if continued and params.seed is not None:
        return [PlannedCall(base, 1, request_sample_seed(request, 0), 0)]
    if params.seed is None or params.n == 1:
        return [PlannedCall(base, params.n, params.seed, 0)]
    return [PlannedCall(f"{base}-s{i}", 1, sample_seed(params.seed, i), i) for i in range(params.n)]
