"""Per-sample seeds: sample i of a request with seed s draws from its own seed, on every engine.

SGLang gives all samples of an `n > 1` request the same `sampling_seed` (identical samples),
so engines derive one seed per sample from (seed, sample index) the same way. A sample continued
after a partial weight swap draws from a seed derived from (seed, sample index, tokens generated
before), so each continuation is reproducible and distinct from the sample's own start.
"""

from __future__ import annotations

import os

from schemas.request import RolloutRequest
from workers.engines.base import ContinuedRequest


def sample_seed(seed: int | None, sample_index: int) -> int:
    """The seed of one sample; a fresh random one when the request has no seed."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
    return (seed * 1_000_003 + sample_index) % (2**63 - 1)


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
