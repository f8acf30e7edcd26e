"""The SGLang wire mapping on SGLang-shaped JSON: requests out, results in, every violation caught."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.request import RolloutRequest
from workers.engines.base import Finish
from workers.engines.seeds import sample_seed
from workers.engines.sglang.expert_ids import ExpertsLayout, decode_routed_experts
from workers.engines.sglang.mapping import (
    generate_calls,
    parse_call_results,
    parse_finish,
    parse_result,
)
from workers.errors import ContractViolation


def req(**fields: Any) -> RolloutRequest:
    return RolloutRequest.model_validate({"id": "q", "input_ids": [5, 6, 7], **fields})


def result(output_ids: list[int], finish: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "text": "xyz",
        "output_ids": output_ids,
        "meta_info": {
            "id": "q-1", "finish_reason": finish or {"type": "length", "length": len(output_ids)},
            "prompt_tokens": 3, "completion_tokens": len(output_ids), "cached_tokens": 2,
            "weight_version": "default", **meta,
        },
    }


def b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode()


# -- request side ------------------------------------------------------------------------------


def test_request_fields_use_sglang_names() -> None:
    request = req(
        sampling_params={"max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                         "stop": [11, 12], "stop_token_ids": [12, 13], "seed": 3, "ignore_eos": True,
                         "repetition_penalty": 1.1},
        logprobs=2, prompt_logprobs=0, return_routed_experts=True,
    )
    [call] = generate_calls(request, rid_prefix="r1")
    assert call.payload == {
        "rid": "r1",
        "input_ids": [5, 6, 7],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_routed_experts": True,
        "routed_experts_start_len": 0,
        "sampling_params": {
            "max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "n": 1,
            "ignore_eos": True, "no_stop_trim": False, "skip_special_tokens": True, "min_new_tokens": 0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.1,
            "stop_token_ids": [11, 12, 13], "sampling_seed": 3,
        },
    }
    assert call.samples == 1 and call.sglang_rids == ["r1"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"logprobs": None}, {}),
        ({"logprobs": 0}, {"return_logprob": True, "top_logprobs_num": 0, "logprob_start_len": -1}),
        ({"logprobs": None, "prompt_logprobs": 0},
         {"return_logprob": True, "top_logprobs_num": 0, "logprob_start_len": 0}),
    ],
)
def test_logprob_fields(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    [call] = generate_calls(req(**fields))
    got = {k: v for k, v in call.payload.items() if k in ("return_logprob", "top_logprobs_num", "logprob_start_len")}
    assert got == expected


def test_string_stops_go_to_stop_and_literal_token_id_strings_stay_strings() -> None:
    [call] = generate_calls(req(sampling_params={"stop": ["token_id:5", "\n\n"]}))
    params = call.payload["sampling_params"]
    assert params["stop"] == ["token_id:5", "\n\n"] and "stop_token_ids" not in params


def test_n_without_seed_is_one_call_with_expanded_rids() -> None:
    [call] = generate_calls(req(sampling_params={"n": 3}), rid_prefix="r")
    assert call.payload["sampling_params"]["n"] == 3 and "sampling_seed" not in call.payload["sampling_params"]
    assert call.samples == 3 and call.sglang_rids == ["r_0", "r_1", "r_2"]


def test_n_with_seed_is_one_call_per_sample_with_distinct_seeds() -> None:
    calls = generate_calls(req(sampling_params={"n": 3, "seed": 7}), rid_prefix="r")
    assert [c.payload["sampling_params"]["n"] for c in calls] == [1, 1, 1]
    seeds = [c.payload["sampling_params"]["sampling_seed"] for c in calls]
    assert seeds == [sample_seed(7, i) for i in range(3)] and len(set(seeds)) == 3
    assert [c.first_sample for c in calls] == [0, 1, 2]
    assert len({c.rid for c in calls}) == 3


def test_default_rids_are_unique_per_call() -> None:
    assert generate_calls(req())[0].rid != generate_calls(req())[0].rid


# -- result side -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        ({"type": "stop", "matched": 0}, Finish("stop", matched=0)),
        ({"type": "stop", "matched": "\n\n"}, Finish("stop", matched="\n\n")),
        ({"type": "length", "length": 4}, Finish("length")),
        ({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
         Finish("abort", message="Aborted")),
    ],
)
def test_finish_shapes(finish: dict[str, Any], expected: Finish) -> None:
    assert parse_finish(finish, who="t") == expected


@pytest.mark.parametrize(
    ("finish", "error"),
    [
        (None, "finish_reason is None"),
        ({"type": "exploded"}, "unknown finish_reason type 'exploded'"),
        ({"type": "stop", "matched": True}, "matched True"),
        ({"type": "stop", "matched": [1, 2]}, "matched [1, 2]"),
        ("stop", "expected an object"),
    ],
)
def test_bad_finish_shapes(finish: Any, error: str) -> None:
    with pytest.raises(ContractViolation, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_finish(finish, who="t")


def test_logprob_triples_top_logprobs_and_prompt_logprobs() -> None:
    request = req(logprobs=2, prompt_logprobs=0)
    body = result(
        [9, 0], {"type": "stop", "matched": 0},
        output_token_logprobs=[[-0.5, 9, None], [-0.25, 0, "<eos>"]],
        output_top_logprobs=[[[-0.5, 9, None], [-1.5, 4, None]], [[-0.25, 0, None], [-2.0, 9, None]]],
        input_token_logprobs=[[None, 5, None], [-3.0, 6, None], [-4.0, 7, None]],
        weight_version="12",
    )
    sample = parse_result(request, body, layout=None, who="t")
    assert sample.token_ids.dtype == np.int32 and sample.token_ids.tolist() == [9, 0]
    assert sample.logprobs is not None and sample.logprobs.dtype == np.float32
    assert sample.logprobs.tolist() == [-0.5, -0.25]
    assert sample.top_logprobs == [[(9, -0.5), (4, -1.5)], [(0, -0.25), (9, -2.0)]]
    assert sample.prompt_logprobs == [None, -3.0, -4.0]
    assert sample.finish == Finish("stop", matched=0)
    assert (sample.text, sample.cached_tokens, sample.weight_version) == ("xyz", 2, 12)


def test_no_logprobs_asked_none_returned() -> None:
    sample = parse_result(req(logprobs=None), result([1, 2]), layout=None, who="t")
    assert sample.logprobs is None and sample.top_logprobs is None and sample.prompt_logprobs is None


GOOD = {"output_token_logprobs": [[-0.5, 9, None], [-0.25, 3, None]]}


@pytest.mark.parametrize(
    ("request_fields", "meta", "error"),
    [
        ({}, {"output_token_logprobs": [[-0.5, 9, None]]}, "1 output_token_logprobs for 2 output_ids"),
        ({}, {}, "output_token_logprobs is NoneType"),
        ({}, {"output_token_logprobs": [[-0.5, 9, None], [-0.25, 4, None]]}, "other token ids"),
        ({}, {"output_token_logprobs": [[-0.5, 9, None], [None, 3, None]]}, "null logprob"),
        ({}, {"output_token_logprobs": [[-0.5, 9, None], ["x", 3, None]]}, "is not a number"),
        ({}, {"output_token_logprobs": [[-0.5, 9, None], [-1.0]]}, "expected \\[logprob, token_id, text\\]"),
        ({"logprobs": 2}, {**GOOD, "output_top_logprobs": [[[-0.5, 9, None], [-1, 2, None]]]}, "1 positions for 2"),
        ({"logprobs": 2}, {**GOOD, "output_top_logprobs": [[[-0.5, 9, None]], [[-0.2, 3, None]]]},
         "has not 2 alternatives"),
        ({"logprobs": 2}, {**GOOD, "output_top_logprobs": [None, None]}, "is NoneType"),
        ({"prompt_logprobs": 0}, {**GOOD, "input_token_logprobs": [[None, 5, None]]}, "1 input_token_logprobs for 3"),
        ({"prompt_logprobs": 0}, {**GOOD, "input_token_logprobs": [[-1.0, 5, None], [-1, 6, None], [-1, 7, None]]},
         "null at position 0 only"),
        ({"prompt_logprobs": 0}, {**GOOD, "input_token_logprobs": [[None, 5, None], [-1, 6, None], [-1, 8, None]]},
         "other token ids than the prompt"),
        ({}, {**GOOD, "cached_tokens": -1}, "cached_tokens"),
    ],
)
def test_result_violations(request_fields: dict[str, Any], meta: dict[str, Any], error: str) -> None:
    body = result([9, 3])
    body["meta_info"].update(meta)
    with pytest.raises(ContractViolation, match=error):
        parse_result(req(**request_fields), body, layout=None, who="t")


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda b: b.pop("meta_info"), "not an object with meta_info"),
        (lambda b: b.pop("output_ids"), "output_ids is missing"),
        (lambda b: b.update(output_ids=[1, "2"]), "output_ids is missing or not a list"),
        (lambda b: b.update(text=5), "text is int"),
        (lambda b: b["meta_info"].pop("finish_reason"), "finish_reason is None"),
    ],
)
def test_malformed_results(mutate: Any, error: str) -> None:
    body = result([9, 3], **GOOD)
    mutate(body)
    with pytest.raises(ContractViolation, match=error):
        parse_result(req(), body, layout=None, who="t")


# -- n > 1 and routed experts -------------------------------------------------------------------


def test_n_results_are_a_list_and_must_match_n() -> None:
    request = req(sampling_params={"n": 2}, logprobs=None)
    [call] = generate_calls(request)
    samples = parse_call_results(call, [result([1]), result([2, 3])], layout=None)
    assert [s.token_ids.tolist() for s in samples] == [[1], [2, 3]]
    with pytest.raises(ContractViolation, match="1 results for 2 samples"):
        parse_call_results(call, result([1]), layout=None)
    with pytest.raises(ContractViolation, match="3 results for 2 samples"):
        parse_call_results(call, [result([1])] * 3, layout=None)


LAYOUT = ExpertsLayout(layers=2, top_k=3, num_experts=16)


def test_routed_experts_decode_to_rows_layers_top_k() -> None:
    request = req(return_routed_experts=True, logprobs=None)
    rows = 3 + 2 - 1
    experts = np.arange(rows * 2 * 3, dtype=np.int32).reshape(rows, 2, 3) % 16
    sample = parse_result(request, result([1, 2], routed_experts=b64(experts)), layout=LAYOUT, who="t")
    assert sample.routed_experts is not None and sample.routed_experts.shape == (4, 2, 3)
    np.testing.assert_array_equal(sample.routed_experts, experts)
    assert sample.routed_experts_start == 0


@pytest.mark.parametrize(
    ("encoded", "error"),
    [
        (b64(np.zeros((3, 2, 3))), "holds 18 ids, expected 24 \\(4 positions x 2 layers x top-3\\)"),
        (b64(np.zeros((5, 2, 3))), "holds 30 ids, expected 24"),
        (b64(np.full((4, 2, 3), 16)), "outside \\[0, 16\\)"),
        ("!!not base64!!", "not valid base64"),
        (base64.b64encode(b"abc").decode(), "not a whole number of int32"),
        (17, "expected base64 text"),
    ],
)
def test_routed_experts_violations(encoded: Any, error: str) -> None:
    body = result([1, 2], routed_experts=encoded)
    with pytest.raises(ContractViolation, match=error):
        parse_result(req(return_routed_experts=True, logprobs=None), body, layout=LAYOUT, who="t")


def test_routed_experts_missing_says_how_to_start_the_server() -> None:
    with pytest.raises(ContractViolation, match="--enable-return-routed-experts"):
        parse_result(req(return_routed_experts=True, logprobs=None), result([1]), layout=LAYOUT, who="t")


def test_routed_experts_empty_when_nothing_routed() -> None:
    one_token_prompt = RolloutRequest(id="q", input_ids=[5], return_routed_experts=True, logprobs=None)
    out = decode_routed_experts(b64(np.zeros((0, 2, 3))), 0, LAYOUT, who="t")
    assert out.shape == (0, 2, 3)
    sample = parse_result(one_token_prompt, result([], routed_experts=""), layout=LAYOUT, who="t")
    assert sample.routed_experts is not None and sample.routed_experts.shape == (0, 2, 3)


def test_layout_from_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 24, "num_experts_per_tok": 8, "num_experts": 128}'
    )
    assert ExpertsLayout.from_model_config(tmp_path) == ExpertsLayout(24, 8, 128)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 24}')
    assert ExpertsLayout.from_model_config(tmp_path) is None
    assert ExpertsLayout.from_model_config(tmp_path / "missing") is None


def test_parse_does_not_mutate_the_body() -> None:
    body = result([9, 3], **GOOD)
    before = copy.deepcopy(body)
    parse_result(req(), body, layout=None, who="t")
    assert body == before


@pytest.mark.parametrize("missing", [{}, {"routed_experts": None}])
def test_routed_experts_missing_behind_a_gateway_names_the_gateway_first(missing: dict[str, Any]) -> None:
    body = result([1], **missing)
    with pytest.raises(ContractViolation, match=r"through the gateway http://gw:1 .*dropped return_routed_experts"):
        parse_result(req(return_routed_experts=True, logprobs=None), body, layout=LAYOUT, who="t", gateway="http://gw:1")
