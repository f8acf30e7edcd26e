"""New weights for vLLM's CPU linear kernels, packed before the pause and swapped in inside it.

vLLM's CPU build computes an unquantized linear layer through a kernel handle it built from the
weight once (`vllm/model_executor/layers/utils.py`, `dispatch_cpu_unquantized_gemm`: for float32,
a oneDNN matmul handle, `create_onednn_mm`), and empties the weight parameter. Changing such a
layer's weights means building its handle again: vLLM's own in-place reload does that inside the
pause, for every changed layer, which in float32 (where every layer changes at every step) costs
what a full reload costs. Here the new handle is built beforehand, from the extension's checked
copy, while vLLM keeps generating on the old one; the pause then only exchanges the two handles'
pointers (`swap`): the compiled model reads the pointer from the same tensor
(`CPUDNNLGEMMHandler.handler_tensor`, kept a tensor by vLLM so that it is not inlined), so it
computes with the new weights at its next step, and the old handle is released with the object
that now holds it.

Before anything is swapped, each new handle is read back through the kernel itself: a row of the
identity matrix times the packed weight gives a column of the weight (one product by 1 plus exact
zeros), compared bit for bit with what was packed, for `READ_BACK_ROWS` rows spread over the
input (all of them would cost a matmul the size of the layer per layer: seconds per push here).
A layer computed any other way (the AMX kernel for bf16, zentorch, a plain `F.linear`) is not
handled here; the extension feeds it to vLLM's reload in the pause. Runs inside vLLM's worker:
imports torch, and vLLM only when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

HANDLER_CLASS = "CPUDNNLGEMMHandler"  # vllm/_custom_ops.py
# Input rows read back through each new handle, evenly spaced, first and last included: each gives a
# whole column of the weight, so a layout mistake (the fused order, a transpose) shows in every one.
READ_BACK_ROWS = 32


def onednn_handler(module: torch.nn.Module) -> Any | None:
    """The oneDNN handle `module` computes with (held by its `cpu_linear` closure), or None."""
    function = getattr(module, "cpu_linear", None)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(value).__name__ == HANDLER_CLASS and isinstance(getattr(value, "handler_tensor", None), torch.Tensor):
            return value
    return None


@dataclass
class Packed:
    """A layer's new handle, built and read back, waiting for the pause."""

    module: torch.nn.Module
    old: Any
    new: Any

    def swap(self) -> None:
        """The new weights in, the old ones out, by exchanging the handles' pointers (in the pause)."""
        old_value = int(self.old.handler_tensor.item())
        self.old.handler_tensor.fill_(int(self.new.handler_tensor.item()))
        self.new.handler_tensor.fill_(old_value)  # released with `self.new` (its __del__)


def pack(module: torch.nn.Module, weight: torch.Tensor) -> Packed | None:
    """A new oneDNN handle of `weight` ([out, in], the layer's whole fused weight) for `module`, checked
    through the kernel; None when the module does not compute through such a handle."""
    old = onednn_handler(module)
    if old is None or (old.k, old.n) != (weight.shape[1], weight.shape[0]):
        return None
    from vllm import _custom_ops as ops

    weight = weight.contiguous()
    new = ops.create_onednn_mm(weight.t(), 32)  # as dispatch_cpu_unquantized_gemm builds it
    rows = torch.unique(torch.linspace(0, weight.shape[1] - 1, READ_BACK_ROWS).long())
    unit = torch.eye(weight.shape[1], dtype=weight.dtype)[rows]
    if not torch.equal(ops.onednn_mm(new, unit, None), weight.t()[rows]):
        raise ValueError(f"the oneDNN handle built for a {list(weight.shape)} {weight.dtype} weight does not compute "
                         "with that weight")
    return Packed(module, old, new)
