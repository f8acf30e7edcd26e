"""What the engines read from a model directory's `config.json`, when it is readable here.

A multimodal model keeps its language model's fields under `text_config`; each reader looks
there first and falls back to the top level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def model_configs(directory: str | Path) -> list[dict[str, Any]]:
    """The directory's config.json, then its `text_config` when it has one (none when not readable)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    text = config.get("text_config")
    return [config, text] if isinstance(text, dict) else [config]


def language_config(directory: str | Path) -> dict[str, Any] | None:
    """The language model's fields: `text_config` when there is one, else the whole config."""
    configs = model_configs(directory)
    return configs[-1] if configs else None


def vocab_size(directory: str | Path) -> int | None:
    """The vocabulary size, `text_config`'s first; None when neither says."""
    sizes = [c["vocab_size"] for c in reversed(model_configs(directory)) if isinstance(c.get("vocab_size"), int)]
    return sizes[0] if sizes else None


def ties_embeddings(directory: str | Path) -> bool:
    """`tie_word_embeddings: true` at either level; False when it says otherwise, says nothing, or is
    not readable here."""
    return any(config.get("tie_word_embeddings") is True for config in model_configs(directory))
