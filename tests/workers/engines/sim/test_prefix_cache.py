"""The prefix cache: blocks found only behind the same prefix, bounded LRU, cleared on demand."""

from __future__ import annotations

import numpy as np

from workers.engines.sim.prefix_cache import PrefixCache


def _ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_a_context_is_cached_in_whole_blocks_and_never_its_last_token() -> None:
    cache = PrefixCache(capacity_tokens=1024, block_tokens=4)
    ids = np.arange(10, dtype=np.int32)
    assert cache.lookup(ids) == 0
    cache.insert(ids)  # blocks [0..3], [4..7]; the partial [8, 9] is not cached
    assert cache.lookup(ids) == 8
    assert cache.lookup(np.arange(20, dtype=np.int32)) == 8  # a longer context sharing the prefix
    assert cache.lookup(np.arange(8, dtype=np.int32)) == 7  # one position is always computed
    assert cache.lookup(_ids(0, 1, 2, 9, 4, 5, 6, 7)) == 0  # the same second block behind another first one


def test_the_least_recently_used_chain_is_evicted_tail_first() -> None:
    cache = PrefixCache(capacity_tokens=16, block_tokens=4)  # four blocks
    old, new = np.arange(0, 9, dtype=np.int32), np.arange(100, 109, dtype=np.int32)
    cache.insert(old)  # two blocks
    cache.insert(new)  # two more: full
    assert cache.lookup(old) == 8  # old becomes the most recent
    cache.insert(np.arange(200, 205, dtype=np.int32))  # one more block evicts new's tail, not its head
    assert len(cache) == 4
    assert cache.lookup(old) == 8
    assert cache.lookup(new) == 4


def test_clear_and_a_zero_capacity_cache_nothing() -> None:
    cache = PrefixCache(capacity_tokens=64, block_tokens=4)
    cache.insert(np.arange(9, dtype=np.int32))
    cache.clear()
    assert cache.lookup(np.arange(9, dtype=np.int32)) == 0
    none = PrefixCache(capacity_tokens=0)
    none.insert(np.arange(64, dtype=np.int32))
    assert none.lookup(np.arange(64, dtype=np.int32)) == 0
