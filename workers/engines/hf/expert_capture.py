"""Capturing the experts a transformers MoE model routes each position to, in SGLang's layout.

transformers 5 MoE models (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, …) route in one router
module per sparse layer, named by the model's `_can_record_outputs["router_logits"]`
recorder; those routers return `(router_logits, routing_weights, expert_indices)`. A forward
hook on every router records `expert_indices`: the ids the model itself used, whatever its
selection rule (softmax top-k, sigmoid with a score-correction bias, group-limited top-k,
sparsemixer). A router that returns only logits is read as the top-k of its logits (softmax
is monotonic, so the top-k ids are those of the probabilities).

The layout is SGLang's (`routed_experts_capturer.py`): `[positions, num_hidden_layers,
num_experts_per_tok]`, one row per position fed through the model, layers by their index in
`model.layers`; a layer without a router (a dense layer of a mixed model) stays zero, as in
SGLang's zero-initialised buffer.

Within a top-k the ids are in the router's own order (score order for `torch.topk`); the shard
stores them ascending, the set the router chose (`workers.rows.table.canonical_routed_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Config keys that name the number of routed experts per layer, across MoE families.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RoutingLayout:
    """How many layers, experts picked per position, and experts per layer."""

    layers: int
    top_k: int
    num_experts: int


def _text_config(config: Any) -> Any:
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _router_class(model: Any) -> tuple[type | None, str | None]:
    recorders = getattr(model, "_can_record_outputs", None) or {}
    spec = recorders.get("router_logits")
    if spec is None:
        return None, None
    if isinstance(spec, type):
        return spec, None
    return getattr(spec, "target_class", None), getattr(spec, "layer_name", None)


class RoutingCapture:
    """Forward hooks on a model's routers; records expert ids while `start()`ed.

    Usage per batch: `start(batch)`, run the forwards, call `step()` after each forward,
    then `finish(rows_per_sample, pads)` for one `[rows, layers, top_k]` int32 array per sample.
    """

    def __init__(self, model: Any, layout: RoutingLayout, routers: Sequence[tuple[int, Any]]) -> None:
        self.layout = layout
        self._torch = __import__("torch")
        self._batch = 0
        self._active = False
        self._current: dict[int, Any] = {}
        self._steps: list[Any] = []
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in routers]

    @classmethod
    def attach(cls, model: Any) -> RoutingCapture | None:
        """Hooks on `model`'s routers, or None for a dense model (no router modules)."""
        target, layer_name = _router_class(model)
        if target is None:
            return None
        routers: list[tuple[int, Any]] = []
        for name, module in model.named_modules():
            if not isinstance(module, target) or (layer_name and layer_name not in name):
                continue
            match = _LAYER_INDEX.search(name)
            if match is None:
                return None  # not a decoder-layer router we can place in the layout
            routers.append((int(match.group(1)), module))
        config = _text_config(model.config)
        top_k = getattr(config, "num_experts_per_tok", None)
        layers = getattr(config, "num_hidden_layers", None)
        experts = next(
            (getattr(config, k) for k in _NUM_EXPERTS_KEYS if isinstance(getattr(config, k, None), int)), None
        )
        if not routers or not isinstance(top_k, int) or not isinstance(layers, int) or experts is None:
            return None
        if any(layer >= layers for layer, _ in routers):
            return None
        return cls(model, RoutingLayout(layers=layers, top_k=top_k, num_experts=int(experts)), routers)

    def _hook(self, layer: int):  # type: ignore[no-untyped-def]
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self._active:
                self._current[layer] = self._expert_ids(output)

        return hook

    def _expert_ids(self, output: Any) -> Any:
        torch = self._torch
        k = self.layout.top_k
        if isinstance(output, tuple) and len(output) >= 3:
            ids = output[2]
            if torch.is_tensor(ids) and not ids.is_floating_point() and ids.shape[-1] == k:
                return ids.reshape(self._batch, -1, k).to(torch.int32)
        logits = output[0] if isinstance(output, tuple) else output
        ids = torch.topk(logits.float(), k, dim=-1).indices
        return ids.reshape(self._batch, -1, k).to(torch.int32)

    def start(self, batch: int) -> None:
        """Record the next forwards of a batch of `batch` sequences."""
        self._batch = batch
        self._current = {}
        self._steps = []
        self._active = True

    def step(self) -> None:
        """Close one forward: its ids as `[batch, seq, layers, top_k]`."""
        torch = self._torch
        if not self._current:
            return
        first = next(iter(self._current.values()))
        batch, seq, k = first.shape
        out = torch.zeros((batch, seq, self.layout.layers, k), dtype=torch.int32, device=first.device)
        for layer, ids in self._current.items():
            out[:, :, layer, :] = ids
        self._steps.append(out)
        self._current = {}

    def finish(self, rows: Sequence[int], skip: Sequence[int] | None = None) -> list[np.ndarray]:
        """One `[rows[i], layers, top_k]` array per sequence: its first `rows[i]` positions after
        the `skip[i]` it does not own (left padding of a batch)."""
        torch = self._torch
        self.stop()
        layout = self.layout
        if not self._steps:
            return [np.zeros((0, layout.layers, layout.top_k), np.int32) for _ in rows]
        every = torch.cat(self._steps, dim=1).cpu().numpy()
        self._steps = []
        offsets = skip if skip is not None else [0] * len(rows)
        return [
            np.ascontiguousarray(every[i, o : o + max(0, r)])
            for i, (r, o) in enumerate(zip(rows, offsets, strict=True))
        ]

    def stop(self) -> None:
        self._active = False
        self._current = {}

    def remove(self) -> None:
        """Detach the hooks (the model is being dropped)."""
        self.stop()
        for handle in self._handles:
            handle.remove()
        self._handles = []
