"""Routed experts as SGLang returns them: base64 of little-endian int32, reshaped and checked.

SGLang (`managers/scheduler_components/batch_result_processor.py`) captures the top-k expert
ids of every layer for positions `[start, prompt + completion - 1)`, so the flat array has
`rows * layers * top_k` entries with `rows = prompt + completion - 1 - start`. The layer count
and top-k are not in the response; they come from the engine's configuration or the model's
`config.json` (`num_hidden_layers`, `num_experts_per_tok`).

The ids come in SGLang's order within each top-k, which is not the score order on every path
(`torch.topk(..., sorted=False)` in several `layers/moe/topk.py` selections); the shard stores
them ascending (`workers.rows.table.canonical_routed_experts`), for every engine alike.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.engines.model_config import language_config
from workers.errors import ContractViolation

# config.json keys that name the number of experts per layer, across MoE families.
_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


@dataclass(frozen=True)
class ExpertsLayout:
    """How many layers route, how many experts each token picks, out of how many."""

    layers: int
    top_k: int
    num_experts: int | None = None

    @classmethod
    def from_model_config(cls, model_dir: str | Path) -> ExpertsLayout | None:
        """Read the layout from a model directory's config.json; None for a dense model."""
        config = language_config(model_dir)
        if config is None:
            return None
        top_k = config.get("num_experts_per_tok")
        layers = config.get("num_hidden_layers")
        if not isinstance(top_k, int) or not isinstance(layers, int) or top_k <= 0:
            return None
        experts = next((config[k] for k in _NUM_EXPERTS_KEYS if isinstance(config.get(k), int)), None)
        return cls(layers=layers, top_k=top_k, num_experts=experts)


def expected_rows(prompt_tokens: int, completion_tokens: int, start: int) -> int:
    """SGLang's row count: one per position whose routing decided a next token."""
    return max(0, prompt_tokens + completion_tokens - 1 - start)


def decode_routed_experts(encoded: object, rows: int, layout: ExpertsLayout, *, who: str) -> np.ndarray:
    """Base64 int32 -> array [rows, layers, top_k]; raises `ContractViolation` on any mismatch."""
    if not isinstance(encoded, str):
        raise ContractViolation(f"{who}: routed_experts is {type(encoded).__name__}, expected base64 text")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ContractViolation(f"{who}: routed_experts is not valid base64 ({exc})") from exc
    if len(raw) % 4:
        raise ContractViolation(f"{who}: routed_experts holds {len(raw)} bytes, not a whole number of int32")
    flat = np.frombuffer(raw, dtype="<i4")
    want = rows * layout.layers * layout.top_k
    if flat.size != want:
        raise ContractViolation(
            f"{who}: routed_experts holds {flat.size} ids, expected {want} "
            f"({rows} positions x {layout.layers} layers x top-{layout.top_k})"
        )
    if flat.size and (flat.min() < 0 or (layout.num_experts is not None and flat.max() >= layout.num_experts)):
        raise ContractViolation(f"{who}: routed_experts has an expert id outside [0, {layout.num_experts})")
    return flat.astype(np.int32).reshape(rows, layout.layers, layout.top_k)
