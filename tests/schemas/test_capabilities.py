"""The capability rules both sides use: what a request needs, what a worker lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.request_file import ParsedRequest, read_request_lines
from schemas.capabilities import Needs, describe, job_needs, missing, needs_of
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities

LINES = [
    {"id": "plain", "input_ids": [5, 9]},
    {"id": "top", "input_ids": [5], "logprobs": 4, "sampling_params": {"stop": [70], "seed": 3}},
    {"id": "moe", "input_ids": [1], "return_routed_experts": True, "prompt_logprobs": 0},
    {"id": "text", "input_ids": [1], "logprobs": None, "sampling_params": {"stop": ["\n"]}},
]


def test_a_parsed_line_and_its_model_need_the_same(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    parsed = read_request_lines(path)
    assert all(isinstance(r, ParsedRequest) for r in parsed)
    models = [RolloutRequest.model_validate(line) for line in LINES]
    assert [needs_of(r) for r in parsed] == [needs_of(m) for m in models]
    assert [needs_of(m) for m in models] == [
        Needs(max_token_id=9),
        Needs(top_logprobs=4, max_token_id=70),
        Needs(routed_experts=True, prompt_logprobs=True, max_token_id=1),
        Needs(stop_strings=True, max_token_id=1),
    ]
    assert job_needs(models) == Needs(top_logprobs=4, prompt_logprobs=True, routed_experts=True, stop_strings=True,
                                      max_token_id=70)


def test_missing_names_each_need_the_worker_lacks() -> None:
    needs = Needs(top_logprobs=4, prompt_logprobs=True, routed_experts=True, stop_strings=True, max_token_id=70)
    assert missing(needs, Capabilities(prompt_logprobs=False, stop_strings=False, vocab_size=64)) == [
        "top-4 logprobs", "prompt logprobs", "routed experts", "stop strings (a tokenizer)",
        "token id 70 in its vocabulary"]
    assert missing(needs, Capabilities(max_top_logprobs=4, routed_experts=True, vocab_size=71)) == []
    assert missing(Needs(max_token_id=-1), Capabilities(vocab_size=1)) == []  # ids not checked
    assert describe(Capabilities(max_top_logprobs=4, routed_experts=True, vocab_size=71)) == \
        "top-4 logprobs, routed experts, vocab 71"


def test_needs_travel_as_json_and_nothing_else_is_taken_for_them() -> None:
    needs = Needs(top_logprobs=2, routed_experts=True, max_token_id=7)
    assert Needs.from_dict(json.loads(json.dumps(needs.as_dict()))) == needs
    for bad in ({"top_logprobs": "2"}, {"routed_experts": 1}, {"anything": True}, [1]):
        with pytest.raises(ValueError, match="needs"):
            Needs.from_dict(bad)  # type: ignore[arg-type]
