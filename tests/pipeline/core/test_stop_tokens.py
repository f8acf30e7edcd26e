"""The ids that end a call as a matched token (`pipeline.core.stop_tokens`), SGLang's rule: both
config files' EOS ids, the tokenizer's EOS and additional stop tokens, the call's own; none with
`ignore_eos`."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.stop_tokens import matched_stop_ids, model_stop_ids
from tests.helpers.models import _char_tokenizer


def test_the_model_stops_on_both_configs_eos_ids_and_the_tokenizers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 7]}))
    tokenizer = _char_tokenizer()  # its EOS is id 0
    tokenizer.add_tokens(["<|eom_id|>"], special_tokens=True)  # one of SGLang's additional stop tokens
    eom = tokenizer.convert_tokens_to_ids("<|eom_id|>")
    model = model_stop_ids(tmp_path, tokenizer)
    assert model == {0, 5, 6, 7, eom}
    assert matched_stop_ids(model, [9], ignore_eos=False) == {0, 5, 6, 7, eom, 9}
    assert matched_stop_ids(model, [9], ignore_eos=True) == frozenset()


def test_a_tokenizer_alone_stops_on_its_eos(tmp_path: Path) -> None:
    assert model_stop_ids(tmp_path / "absent", _char_tokenizer()) == {0}
    assert model_stop_ids(None, None) == frozenset()
