"""The weight store's decoding half, importing only numpy, zstandard and xxhash: words, `apply`, `checksum`.

`pipeline.core.weights.codec` (encoding, the trainer side) and `store.checksum` build on it; the vLLM
worker extension (`workers.engines.vllm.weight_extension`) loads this file by its path inside
vLLM's worker process, which has neither redis nor pyarrow, so it must never import the
`pipeline` package. Decoding errors are `DecodeError` here; `codec.apply` raises them as
`pipeline.core.errors.CorruptDeltaError`.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash
import zstandard

# safetensors dtype names -> the unsigned word holding one element's bits.
WORDS: dict[str, type[np.unsignedinteger]] = {
    "F64": np.uint64, "I64": np.uint64, "U64": np.uint64,
    "F32": np.uint32, "I32": np.uint32, "U32": np.uint32,
    "F16": np.uint16, "BF16": np.uint16, "I16": np.uint16, "U16": np.uint16,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "I8": np.uint8, "U8": np.uint8, "BOOL": np.uint8,
}
HEADER = struct.Struct("<QQ")  # sparse: changed count, compressed gaps length


class DecodeError(ValueError):
    """A stored blob that does not decode to the tensor it changes."""


def word_type(dtype: str) -> type[np.unsignedinteger]:
    try:
        return WORDS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of the safetensors dtypes {sorted(WORDS)}") from None


def checksum(words: np.ndarray) -> str:
    """xxh3-128 of a tensor's bits: a checksum against damage and drift (6 GB/s; sha256 ran at 0.45
    GB/s here, longer than applying a delta), not a signature: who may write the store is the
    deployment's allowed weight prefixes."""
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(words)).cast("B"))


def planes(words: np.ndarray) -> bytes:
    """The words' bytes, byte plane by byte plane (all first bytes, then all second bytes, ...)."""
    width = words.dtype.itemsize
    return words.view(np.uint8).reshape(-1, width).T.tobytes()


def unplanes(data: bytes, count: int, word: type[np.unsignedinteger]) -> np.ndarray:
    width = np.dtype(word).itemsize
    if len(data) != count * width:
        raise DecodeError(f"{len(data)} bytes decoded, {count * width} expected")
    return np.frombuffer(data, np.uint8).reshape(width, count).T.copy().view(word).reshape(-1)


def decompress(blob: bytes, size: int) -> bytes:
    try:
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise DecodeError(f"not a zstd frame ({exc})") from exc
    if len(data) != size:
        raise DecodeError(f"{len(data)} bytes decoded, {size} expected")
    return data


def apply(encoding: str, blob: bytes, words: np.ndarray) -> None:
    """Rewrite `words` (the tensor's current bits, writable) into the version the blob encodes."""
    word = words.dtype.type
    count = words.size
    if encoding == "same":
        if blob:
            raise DecodeError(f"{len(blob)} bytes stored for an unchanged tensor")
    elif encoding == "xor":
        # Plane by plane into the words' own bytes: no transposed copy of the tensor (3x faster).
        stored = np.frombuffer(decompress(blob, count * words.itemsize), np.uint8).reshape(words.itemsize, count)
        own = words.view(np.uint8).reshape(count, words.itemsize)
        for plane in range(words.itemsize):
            np.bitwise_xor(own[:, plane], stored[plane], out=own[:, plane])
    elif encoding == "raw":
        words[:] = unplanes(decompress(blob, count * words.itemsize), count, word)
    elif encoding == "sparse":
        if len(blob) < HEADER.size:
            raise DecodeError(f"a sparse delta of {len(blob)} bytes has no header")
        changed, gaps_len = HEADER.unpack_from(blob)
        if changed > count or HEADER.size + gaps_len > len(blob):
            raise DecodeError(f"a sparse delta claims {changed} changes of {count} elements")
        gap_word = np.uint64 if count > 2**32 else np.uint32
        gaps_raw = decompress(blob[HEADER.size:HEADER.size + gaps_len], changed * np.dtype(gap_word).itemsize)
        index = np.cumsum(np.frombuffer(gaps_raw, gap_word), dtype=np.uint64)
        if changed and int(index[-1]) >= count:
            raise DecodeError(f"a sparse delta changes element {int(index[-1])} of {count}")
        values = unplanes(decompress(blob[HEADER.size + gaps_len:], changed * words.itemsize), changed, word)
        words[index] = values
    else:
        raise DecodeError(f"unknown encoding {encoding!r}")
