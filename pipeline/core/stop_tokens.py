"""Which token ids finish a call as a matched stop token: SGLang's rule, one copy for the engines
and for `pipeline serve`.

From SGLang 0.5.23: a sampled token finishes the call as a matched token
(`managers/schedule_batch.py: Req._check_token_based_finish`) when it is one of the request's
`stop_token_ids`, one of the model's EOS ids (`configs/model_config.py: _get_hf_eos_token_id`:
config.json's `eos_token_id` and generation_config.json's, both), the tokenizer's EOS, or one of
the tokenizer's additional stop tokens (`utils/hf_transformers/common.py:
attach_additional_stop_token_ids`: turn-end markers some checkpoints ship without EOS metadata);
none of them with `ignore_eos`. The token stays in `output_ids`; the answer's text leaves it out
(unless `no_stop_trim`).

An engine stops on these ids; a streamed answer's server holds a last token that is one of them
until it knows whether the call ended there (`pipeline.serve.live`), so the streamed text is the
non-streamed answer's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ADDITIONAL_STOP_TEXTS = ("<|eom_id|>", "<|content_model_end_sampling|>", "<|ifm|im_end|>")


def _declared_eos(path: Path) -> set[int]:
    """A JSON config's `eos_token_id` (an id or a list of ids); none when the file is absent."""
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _model_file(model: str | Path, name: str) -> Path | None:
    """`name` of a local model directory, or of a Hugging Face repository where the local cache has
    it (no network: a server's start does not wait on one); None where there is none."""
    if Path(model).is_dir():
        return Path(model) / name
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), name)
    except Exception:  # not a repository id
        return None
    return Path(cached) if isinstance(cached, str) else None


def model_stop_ids(model: str | Path | None, tokenizer: Any | None) -> frozenset[int]:
    """The ids that end any call of this model (user stop ids aside): the EOS ids its config.json and
    generation_config.json declare (`model`: its directory, or a Hugging Face repository's cached
    files), the tokenizer's EOS and its additional stop tokens."""
    ids: set[int] = set()
    if model is not None:
        for name in ("config.json", "generation_config.json"):
            path = _model_file(model, name)
            if path is not None:
                ids |= _declared_eos(path)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        ids |= {int(added[text]) for text in ADDITIONAL_STOP_TEXTS if text in added}
    return frozenset(ids)


def matched_stop_ids(model_ids: frozenset[int], stop_token_ids: Iterable[int] | None, *,
                     ignore_eos: bool) -> frozenset[int]:
    """The ids that end one call as a matched token: the model's and the call's own `stop_token_ids`;
    none with `ignore_eos` (SGLang then ignores the call's stop ids too)."""
    if ignore_eos:
        return frozenset()
    return model_ids | frozenset(int(t) for t in stop_token_ids or ())
