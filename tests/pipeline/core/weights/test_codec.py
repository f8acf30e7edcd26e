"""Tensor deltas: every encoding reproduces the new bits exactly, the smaller one is kept, a bad blob is refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.weights import codec


def _f32(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float32).view(np.uint32)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.floats(0.0, 1.0), st.sampled_from(["F32", "BF16", "I64", "U8"]), st.integers(0, 99))
def test_any_change_round_trips_bit_for_bit(size: int, share: float, dtype: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    word = codec.word_type(dtype)
    info = np.iinfo(word)
    old = rng.integers(0, info.max, size, dtype=word, endpoint=True)
    new = old.copy()
    changed = rng.random(size) < share
    new[changed] = rng.integers(0, info.max, int(changed.sum()), dtype=word, endpoint=True)
    encoding, blob = codec.encode(old, new)
    words = old.copy()
    codec.apply(encoding, blob, words)
    assert np.array_equal(words, new)
    assert encoding == "same" if np.array_equal(old, new) else encoding in ("xor", "sparse")
    for other, make in (("xor", codec.encode_xor), ("sparse", codec.encode_sparse)):
        words = old.copy()
        codec.apply(other, make(old, new), words)  # type: ignore[arg-type]
        assert np.array_equal(words, new)


def test_the_smaller_encoding_wins_per_kind_of_change() -> None:
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.02, 100_000).astype(np.float32)
    # Every element moves a little (float32 after an optimizer step): the xor's high bytes are zero.
    moved = _f32(weights + rng.normal(0, 1e-6, weights.size).astype(np.float32))
    assert codec.encode(_f32(weights), moved)[0] == "xor"
    # A few elements change (bf16 after a small step: most updates round away).
    few = _f32(weights).copy()
    few[rng.choice(weights.size, 100, replace=False)] ^= rng.integers(1, 1 << 16, 100, dtype=np.uint32)
    encoding, blob = codec.encode(_f32(weights), few)
    assert encoding == "sparse" and len(blob) < 100 * 8  # under an index and a value each


def test_a_new_tensor_is_stored_raw() -> None:
    new = np.arange(10, dtype=np.uint16)
    encoding, blob = codec.encode(None, new)
    words = np.zeros(10, np.uint16)
    codec.apply(encoding, blob, words)
    assert encoding == "raw" and np.array_equal(words, new)


@pytest.mark.parametrize("encoding", ["xor", "sparse", "raw"])
def test_a_damaged_blob_is_refused_not_applied_half(encoding: str) -> None:
    old = np.arange(1000, dtype=np.uint32)
    new = old.copy()
    new[::7] += 3
    blob = {"xor": codec.encode_xor, "sparse": codec.encode_sparse}.get(encoding, lambda o, n: codec.encode_raw(n))(
        old, new)
    for damaged in (blob[: len(blob) // 2], b"\0" * 16 + blob[16:]):
        words = old.copy()
        with pytest.raises(codec.CorruptDeltaError):
            codec.apply(encoding, damaged, words)  # type: ignore[arg-type]
        assert np.array_equal(words, old)
