"""safetensors files on any fsspec filesystem, as raw bits: written bucket by bucket, read tensor by tensor.

The format is safetensors' own (an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then the data), so every file the store writes opens
with `safetensors.safe_open`; reading here needs neither torch nor the whole file in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np

from pipeline.core.errors import SafetensorsError
from pipeline.core.weights.codec import WORDS, word_type

MAX_HEADER_BYTES = 100 * 1024 * 1024




@dataclass(frozen=True)
class TensorBits:
    """One tensor as its raw bits: `words` is a 1-D array of unsigned words of the dtype's width."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    words: np.ndarray


def encode_file(tensors: list[TensorBits]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A safetensors file's bytes, and each tensor's (absolute offset, length) in it."""
    header: dict[str, object] = {}
    spans: dict[str, tuple[int, int]] = {}
    position = 0
    for tensor in tensors:
        size = tensor.words.nbytes
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [position, position + size]}
        spans[tensor.name] = (position, size)
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    data = b"".join([struct.pack("<Q", len(text)), text, *(t.words.tobytes() for t in tensors)])
    return data, {name: (start + offset, size) for name, (offset, size) in spans.items()}


def read_header(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """`{name: (dtype, shape, absolute offset, length)}` of a safetensors file, checked."""
    with fs.open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise SafetensorsError(f"{path}: {len(head)} bytes, too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header of {size} bytes, over the limit of {MAX_HEADER_BYTES}")
        raw = handle.read(size)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SafetensorsError(f"{path}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: tensor {name!r}: malformed entry {info!r}") from exc
        if dtype not in WORDS:
            raise SafetensorsError(f"{path}: tensor {name!r}: dtype {dtype!r} is not supported ({sorted(WORDS)})")
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(word_type(dtype)).itemsize
        if end - begin != expected:
            raise SafetensorsError(f"{path}: tensor {name!r}: {end - begin} data bytes for shape {list(shape)} "
                                   f"of {dtype} ({expected} expected)")
        out[name] = (dtype, shape, 8 + size + begin, end - begin)
    return out


def read_range(fs: fsspec.AbstractFileSystem, path: str, offset: int, length: int) -> bytes:
    with fs.open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read(length)
    if len(data) != length:
        raise SafetensorsError(f"{path}: {len(data)} bytes at offset {offset}, {length} expected (truncated?)")
    return data


def read_checkpoint(url: str) -> Iterator[TensorBits]:
    """Every tensor of a checkpoint directory's `*.safetensors` files (sorted), one at a time."""
    fs, root = fsspec.core.url_to_fs(url)
    files = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".safetensors"))
    if not files:
        raise SafetensorsError(f"{url}: no *.safetensors file in the checkpoint directory")
    for path in files:
        for name, (dtype, shape, offset, length) in read_header(fs, path).items():
            words = np.frombuffer(read_range(fs, path, offset, length), word_type(dtype)).copy()
            yield TensorBits(name, dtype, shape, words)
