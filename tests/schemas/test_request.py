"""The request line's strict validation and the stop contract's input side."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.request import RolloutRequest, SamplingParams


def line(**fields: object) -> dict:
    return {"id": "r", "input_ids": [1, 2, 3], **fields}


def test_defaults_follow_sglang() -> None:
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.n) == (128, 1.0, 1.0, -1, 1)
    assert RolloutRequest.model_validate(line()).logprobs == 0


@pytest.mark.parametrize(
    ("stop", "strings", "ids"),
    [
        ("\n\n", ("\n\n",), ()),
        ([" The", "\n\n"], (" The", "\n\n"), ()),
        ([32, 34], (), (32, 34)),
        ("token_id:576", ("token_id:576",), ()),
        (["token_id:576"], ("token_id:576",), ()),
        (None, (), ()),
    ],
)
def test_stop_forms(stop: object, strings: tuple, ids: tuple) -> None:
    params = SamplingParams.model_validate({"stop": stop})
    assert params.stop_strings == strings
    assert params.user_stop_token_ids == ids


def test_stop_token_ids_merge_with_token_stops() -> None:
    params = SamplingParams.model_validate({"stop": [5, 6], "stop_token_ids": [6, 7]})
    assert params.user_stop_token_ids == (5, 6, 7)


@pytest.mark.parametrize(
    ("stop", "reason"),
    [
        (576, "bare number"),
        (True, "not a bool"),
        ([1, "a"], "mixes strings and token ids"),
        ([-3], "negative"),
        ("", "empty stop string"),
        (["a", ""], "empty stop string"),
        ([True], "not bools"),
        ([1.5], "neither a string nor a token id"),
    ],
)
def test_rejected_stops(stop: object, reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        SamplingParams.model_validate({"stop": stop})


@pytest.mark.parametrize(
    "fields",
    [
        {"input_ids": []},
        {"input_ids": [1, True]},
        {"input_ids": [1, 2.0]},
        {"input_ids": [-1]},
        {"input_ids": [2**31]},
        {"logprobs": True},
        {"logprobs": -1},
        {"sampling_params": {"n": True}},
        {"sampling_params": {"temperature": "1.0"}},
        {"sampling_params": {"top_k": 0}},
        {"sampling_params": {"top_p": 0.0}},
        {"sampling_params": {"max_new_token": 5}},
        {"id": ""},
        {"prompt_logprobs": 3},
        {"unknown": 1},
    ],
)
def test_strictness(fields: dict) -> None:
    with pytest.raises(ValidationError):
        RolloutRequest.model_validate(line(**fields))


def test_ints_are_accepted_for_float_fields() -> None:
    params = SamplingParams.model_validate({"temperature": 0, "top_p": 1})
    assert params.greedy and params.top_p == 1.0


def test_a_routing_key_is_a_short_visible_ascii_string() -> None:
    assert RolloutRequest.model_validate(line(routing_key="session-7")).routing_key == "session-7"
    assert RolloutRequest.model_validate(line()).routing_key is None
    for bad in ("", "two words", "caf\u00e9", "k" * 129, 7):
        with pytest.raises(ValidationError, match="routing_key"):
            RolloutRequest.model_validate(line(routing_key=bad))
