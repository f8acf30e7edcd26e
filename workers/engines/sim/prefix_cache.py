"""A bounded prefix cache over token ids: what an engine's KV cache keeps between requests.

Sequences are cut into blocks of `block_tokens` ids; each full block is known by a hash chained
over every block before it (vLLM's automatic prefix caching works the same way), so a block is
found only behind the same prefix. The cache holds at most `capacity_tokens` worth of blocks
and evicts the least recently used (a chain's tail before its head). `lookup` says how many
leading tokens of a context are cached (never the last one: an engine computes at least one
position to sample from);
`insert` caches a sequence's full blocks; `clear` forgets everything (a weight swap).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class PrefixCache:
    """LRU over chained block hashes; `capacity_tokens` 0 caches nothing."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.capacity_blocks = max(0, capacity_tokens) // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def _chain(self, ids: np.ndarray) -> list[int]:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        size = self.block_tokens
        hashes, previous = [], 0
        for start in range(0, len(ids) - size + 1, size):
            previous = hash((previous, ids[start:start + size].tobytes()))
            hashes.append(previous)
        return hashes

    def lookup(self, ids: np.ndarray) -> int:
        """Leading tokens of `ids` found cached (at most len - 1); the blocks found become recent."""
        if not self.capacity_blocks:
            return 0
        found = []
        for block in self._chain(ids):
            if block not in self._blocks:
                break
            found.append(block)
        self._touch(found)
        hits = len(found)
        return min(hits * self.block_tokens, max(0, len(ids) - 1))

    def insert(self, ids: np.ndarray) -> None:
        """Cache the full blocks of `ids`, evicting the least recently used past capacity."""
        if not self.capacity_blocks:
            return
        self._touch(self._chain(ids))
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def _touch(self, chain: list[int]) -> None:
        """Make a chain's blocks the most recent, its first block last: eviction takes a chain's
        tail before its head, so what stays cached is always a reachable prefix."""
        for block in reversed(chain):
            self._blocks[block] = None
            self._blocks.move_to_end(block)

    def clear(self) -> None:
        self._blocks.clear()
