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
"""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
import zstandard

from pipeline.errors import CorruptDeltaError

Encoding = Literal["same", "xor", "sparse", "raw"]
ENCODINGS: tuple[Encoding, ...] = ("same", "xor", "sparse", "raw")
ZSTD_LEVEL = 3

# safetensors dtype names -> the unsigned word holding one element's bits.
WORDS: dict[str, type[np.unsignedinteger]] = {
    "F64": np.uint64, "I64": np.uint64, "U64": np.uint64,
    "F32": np.uint32, "I32": np.uint32, "U32": np.uint32,
    "F16": np.uint16, "BF16": np.uint16, "I16": np.uint16, "U16": np.uint16,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "I8": np.uint8, "U8": np.uint8, "BOOL": np.uint8,
}
_HEADER = struct.Struct("<QQ")  # sparse: changed count, compressed gaps length




def word_type(dtype: str) -> type[np.unsignedinteger]:
    try:
        return WORDS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of the safetensors dtypes {sorted(WORDS)}") from None


def _planes(words: np.ndarray) -> bytes:
    """The words' bytes, byte plane by byte plane (all first bytes, then all second bytes, ...)."""
    width = words.dtype.itemsize
    return words.view(np.uint8).reshape(-1, width).T.tobytes()


def _unplanes(data: bytes, count: int, word: type[np.unsignedinteger]) -> np.ndarray:
    width = np.dtype(word).itemsize
    if len(data) != count * width:
        raise CorruptDeltaError(f"{len(data)} bytes decoded, {count * width} expected")
    return np.frombuffer(data, np.uint8).reshape(width, count).T.copy().view(word).reshape(-1)


def _compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def _decompress(blob: bytes, size: int) -> bytes:
    try:
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise CorruptDeltaError(f"not a zstd frame ({exc})") from exc
    if len(data) != size:
        raise CorruptDeltaError(f"{len(data)} bytes decoded, {size} expected")
    return data


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
    """Rewrite `words` (the tensor's current bits, writable) into the version the blob encodes."""
    word = words.dtype.type
    count = words.size
    if encoding == "same":
        if blob:
            raise CorruptDeltaError(f"{len(blob)} bytes stored for an unchanged tensor")
    elif encoding == "xor":
        # Plane by plane into the words' own bytes: no transposed copy of the tensor (3x faster).
        planes = np.frombuffer(_decompress(blob, count * words.itemsize), np.uint8).reshape(words.itemsize, count)
        own = words.view(np.uint8).reshape(count, words.itemsize)
        for plane in range(words.itemsize):
            np.bitwise_xor(own[:, plane], planes[plane], out=own[:, plane])
    elif encoding == "raw":
        words[:] = _unplanes(_decompress(blob, count * words.itemsize), count, word)
    elif encoding == "sparse":
        if len(blob) < _HEADER.size:
            raise CorruptDeltaError(f"a sparse delta of {len(blob)} bytes has no header")
        changed, gaps_len = _HEADER.unpack_from(blob)
        if changed > count or _HEADER.size + gaps_len > len(blob):
            raise CorruptDeltaError(f"a sparse delta claims {changed} changes of {count} elements")
        gap_word = np.uint64 if count > 2**32 else np.uint32
        gaps_raw = _decompress(blob[_HEADER.size:_HEADER.size + gaps_len], changed * np.dtype(gap_word).itemsize)
        index = np.cumsum(np.frombuffer(gaps_raw, gap_word), dtype=np.uint64)
        if changed and int(index[-1]) >= count:
            raise CorruptDeltaError(f"a sparse delta changes element {int(index[-1])} of {count}")
        values = _unplanes(_decompress(blob[_HEADER.size + gaps_len:], changed * words.itemsize), changed, word)
        words[index] = values
    else:
        raise CorruptDeltaError(f"unknown encoding {encoding!r}")
