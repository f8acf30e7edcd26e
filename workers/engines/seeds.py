"""Per-sample seeds: sample i of a request with seed s draws from its own seed, on every engine.

SGLang gives all samples of an `n > 1` request the same `sampling_seed` (identical samples),
so engines derive one seed per sample from (seed, sample index) the same way.
"""

from __future__ import annotations

import os


def sample_seed(seed: int | None, sample_index: int) -> int:
    """The seed of one sample; a fresh random one when the request has no seed."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
    return (seed * 1_000_003 + sample_index) % (2**63 - 1)
