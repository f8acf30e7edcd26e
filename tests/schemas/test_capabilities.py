"""The capability rules both sides use: what a request needs, what a worker lacks."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.submit.request_file import ParsedRequest, read_request_lines
from schemas.capabilities import SAMPLING_RULES, Needs, describe, job_needs, missing, needs_of
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities

LINES = [
    {"id": "plain", "input_ids": [5, 9]},
    {"id": "top", "input_ids": [5], "logprobs": 4, "sampling_params": {"stop": [70], "seed": 3}},
    {"id": "moe", "input_ids": [1], "return_routed_experts": True, "prompt_logprobs": 0},
    {"id": "text", "input_ids": [1], "logprobs": None, "sampling_params": {"stop": ["\n"]}},
    {"id": "hot", "input_ids": [1], "prompt_logprobs": 0,
     "sampling_params": {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5, "seed": 1}},
    {"id": "rep", "input_ids": [1], "logprobs": None,
     "sampling_params": {"temperature": 0.7, "repetition_penalty": 1.1}},
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
        Needs(prompt_logprobs=True, max_token_id=1, tempered_logprobs=True, filtered_logprobs=True,
              penalised_logprobs=True, tempered_prompt_logprobs=True),
        Needs(max_token_id=1, repetition_penalty=True),  # no logprobs asked: only the penalty itself
    ]
    assert job_needs(models[:4]) == Needs(top_logprobs=4, prompt_logprobs=True, routed_experts=True,
                                          stop_strings=True, max_token_id=70)


@pytest.mark.parametrize(("sampling", "logprobs", "prompt_logprobs", "needed"), [
    # Greedy is the plain log-softmax everywhere: neither its temperature nor a filter matters.
    ({"temperature": 0.0, "top_k": 5}, 0, 0, set()),
    ({"temperature": 1.0}, 0, 0, set()),
    ({"temperature": 1.0, "top_k": 5}, 0, None, {"filtered_logprobs"}),
    ({"temperature": 0.7}, 0, None, {"tempered_logprobs"}),
    ({"temperature": 0.7}, None, 0, {"tempered_prompt_logprobs"}),
    ({"temperature": 0.0, "frequency_penalty": 0.1}, 0, None, {"penalised_logprobs"}),
    ({"temperature": 0.0, "min_new_tokens": 2}, 0, None, {"penalised_logprobs"}),
    ({"temperature": 0.7, "top_k": 5, "min_new_tokens": 2}, None, None, set()),  # no logprobs asked
])
def test_logprobs_need_the_sampling_rules_their_settings_touch(sampling: dict, logprobs: int | None,
                                                               prompt_logprobs: int | None, needed: set[str]) -> None:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": [1], "logprobs": logprobs,
                                             "prompt_logprobs": prompt_logprobs, "sampling_params": sampling})
    rules = {name for name in SAMPLING_RULES if getattr(needs_of(request), name)}
    assert rules == needed
    lacking = Capabilities(**dict.fromkeys(SAMPLING_RULES, False))
    assert missing(needs_of(request), lacking) == [SAMPLING_RULES[name][0] for name in SAMPLING_RULES
                                                   if name in needed]
    assert missing(needs_of(request), Capabilities()) == []  # every engine but vLLM meets them all


def test_missing_names_each_need_the_worker_lacks() -> None:
    needs = Needs(top_logprobs=4, prompt_logprobs=True, routed_experts=True, stop_strings=True, max_token_id=70)
    assert missing(needs, Capabilities(prompt_logprobs=False, stop_strings=False, vocab_size=64)) == [
        "top-4 logprobs", "prompt logprobs", "routed experts", "stop strings (a tokenizer)",
        "token id 70 in its vocabulary"]
    assert missing(needs, Capabilities(max_top_logprobs=4, routed_experts=True, vocab_size=71)) == []
    assert missing(Needs(max_token_id=-1), Capabilities(vocab_size=1)) == []  # ids not checked
    assert describe(Capabilities(max_top_logprobs=4, routed_experts=True, vocab_size=71)) == \
        "top-4 logprobs, routed experts, vocab 71"
    assert describe(Capabilities(tempered_logprobs=False, repetition_penalty=False)) == (
        "no top-k logprobs, no routed experts, no logprobs at a temperature other than 0 or 1, "
        "no repetition_penalty (over generated tokens only, as SGLang)")


def test_needs_travel_as_json_and_nothing_else_is_taken_for_them() -> None:
    needs = Needs(top_logprobs=2, routed_experts=True, max_token_id=7, tempered_logprobs=True)
    assert Needs.from_dict(json.loads(json.dumps(needs.as_dict()))) == needs
    # Only what differs from the defaults travels: a job that needs nothing special carries {}.
    assert needs.as_dict() == {"top_logprobs": 2, "routed_experts": True, "max_token_id": 7, "tempered_logprobs": True}
    assert Needs().as_dict() == {} and Needs.from_dict({}) == Needs()
    # Needs stored by a release before the sampling rules read as needing none of them.
    assert Needs.from_dict({"top_logprobs": 2}) == Needs(top_logprobs=2)
    for bad in ({"top_logprobs": "2"}, {"routed_experts": 1}, {"anything": True}, [1]):
        with pytest.raises(ValueError, match="needs"):
            Needs.from_dict(bad)  # type: ignore[arg-type]


def test_the_union_of_needs_takes_each_field_from_either_side() -> None:
    asked = {field.name: (3 if field.type == "int" else True) for field in fields(Needs)}
    for name, value in asked.items():
        one = Needs(**{name: value})
        assert Needs() | one == one | Needs() == one | one == one
        assert (one | Needs(top_logprobs=1)).top_logprobs == (3 if name == "top_logprobs" else 1)
    assert Needs(max_token_id=5) | Needs(max_token_id=9) == Needs(max_token_id=9)
