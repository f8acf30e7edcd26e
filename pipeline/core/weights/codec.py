"""How one tensor's change between two versions is written: the smaller of two encodings, exact.

A tensor travels as its raw bits (`words`: a 1-D numpy array of unsigned words of the dtype's
width, so nothing is ever rounded). A delta from `old` to `new` is one of:

- `same`: no element changed (nothing stored);
- `xor`: `old ^ new`, split into byte planes (the high bytes of a small change are zero, so each
  plane is runs of zeros) and zstd-compressed — small when most elements change a little
  (float32 master weights after an optimizer step: sign and exponent bits stay, low mantissa
  bits move);
- `sparse`: the indices that changed (as gaps, zstd) and their new words (byte planes, zstd) —
  small when few elements change (bf16 after a step at lr ~1e-6: most updates round away);
- `raw`: the new words, zstd-compressed (a tensor that is new, or whose change compresses worse).

`encode` computes `xor` and `sparse` and keeps the smaller, so the choice is measured per tensor,
per push (`benchmarks/delta_push.py` reports which wins per dtype). `apply` rewrites a tensor's
words in place and refuses a blob that does not decode to the tensor's size (`CorruptDeltaError`).
Decoding is `codec_core` (numpy, zstandard, xxhash only: the vLLM worker extension loads it by path).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import zstandard

from pipeline.core.errors import CorruptDeltaError
from pipeline.core.weights import codec_core
from pipeline.core.weights.codec_core import HEADER as _HEADER
from pipeline.core.weights.codec_core import WORDS as WORDS
from pipeline.core.weights.codec_core import planes as _planes
from pipeline.core.weights.codec_core import word_type as word_type

Encoding = Literal["same", "xor", "sparse", "raw"]
ENCODINGS: tuple[Encoding, ...] = ("same", "xor", "sparse", "raw")
ZSTD_LEVEL = 3


def _compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def encode_xor(old: np.ndarray, new: np.ndarray) -> bytes:
    return _compress(_planes(np.bitwise_xor(old, new)))


def encode_sparse(old: np.ndarray, new: np.ndarray) -> bytes:
    changed = np.flatnonzero(old != new)
    gaps = np.diff(changed, prepend=0).astype(np.uint64 if new.size > 2**32 else np.uint32)
    gaps_z = _compress(gaps.tobytes())
    return _HEADER.pack(len(changed), len(gaps_z)) + gaps_z + _compress(_planes(new[changed]))


def encode_raw(new: np.ndarray) -> bytes:
    return _compress(_planes(new))


def encode(old: np.ndarray | None, new: np.ndarray) -> tuple[Encoding, bytes]:
    """The smallest exact encoding of `old` -> `new` (same word type and size; no `old`: `raw`)."""
    if old is None or old.dtype != new.dtype or old.size != new.size:
        return "raw", encode_raw(new)
    if np.array_equal(old, new):
        return "same", b""
    xor = encode_xor(old, new)
    sparse = encode_sparse(old, new)
    return ("xor", xor) if len(xor) <= len(sparse) else ("sparse", sparse)


def apply(encoding: Encoding, blob: bytes, words: np.ndarray) -> None:
    """Rewrite `words` (the tensor's current bits, writable) into the version the blob encodes
    (`codec_core.apply`, whose decoding errors are raised here as `CorruptDeltaError`)."""
    try:
        codec_core.apply(encoding, blob, words)
    except codec_core.DecodeError as exc:
        raise CorruptDeltaError(str(exc)) from exc
