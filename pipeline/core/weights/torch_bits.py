"""torch tensors as raw bits for the weight store (torch side: imported only where torch is)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from pipeline.core.weights.codec import word_type
from pipeline.core.weights.safetensors_io import TensorBits

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
# A signed integer type of each width: torch views any dtype's bits as one, numpy reads it.
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors name ({sorted(map(str, DTYPES))})") from None


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def words_view(tensor: torch.Tensor) -> np.ndarray:
    """The bits of a contiguous CPU tensor as unsigned words, sharing its memory (writes go through)."""
    flat = tensor.reshape(-1)
    width = tensor.element_size()
    signed = flat.view(torch.uint8) if tensor.dtype == torch.bool else flat.view(_SIGNED[width])
    return signed.numpy().view(word_type(dtype_name(tensor.dtype)))


def to_bits(name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorBits:
    """A copy of `tensor`'s bits (cast to `dtype` first when given; a cast is a rounding the trainer chose)."""
    value = tensor.detach()
    if dtype is not None and value.dtype != dtype:
        value = value.to(dtype)
    value = value.to("cpu", copy=True).contiguous() if value.device.type != "cpu" else value.contiguous().clone()
    return TensorBits(name, dtype_name(value.dtype), tuple(value.shape), words_view(value))


def from_words(words: np.ndarray, dtype: str, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    width = np.dtype(words.dtype).itemsize
    signed = torch.from_numpy(np.ascontiguousarray(words).view(np.dtype(f"i{width}")))
    value = signed.view(torch.uint8).view(torch.bool) if dtype == "BOOL" else signed.view(torch_dtype(dtype))
    return value.reshape(tuple(shape))


def unique_tensors(state_dict: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a state dict, each storage once (a tied weight under its first name)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


def state_dict_bits(state_dict: Mapping[str, Any], dtype: torch.dtype | None = None) -> Iterator[TensorBits]:
    """Each tensor of a state dict as bits, one copy at a time (floating ones cast to `dtype` if given)."""
    for name, tensor in unique_tensors(state_dict):
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        yield to_bits(name, tensor, cast)
