"""Exponential backoff with jitter, shared by every retry loop of the worker side."""

from __future__ import annotations

import random


def backoff_s(retry: int, base_s: float, cap_s: float) -> float:
    """Seconds before retry number `retry` (1-based): base doubling per retry, capped, times 0.5-1."""
    return min(cap_s, base_s * 2 ** (retry - 1)) * random.uniform(0.5, 1.0)
