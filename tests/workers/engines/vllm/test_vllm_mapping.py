"""vLLM's `/v1/completions` wire format both ways, on answers recorded from a real vLLM 0.32 server
(tests/fixtures/vllm), and which requests each `--logprobs-mode` serves exactly."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from schemas.capabilities import missing, needs_of
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from tests.workers.engines.fake_vllm import fixture, request_of
from workers.engines.base import ContinuedRequest, Finish, SampleOutput
from workers.engines.seeds import continuation_seed, sample_seed
from workers.engines.vllm.mapping import (
    CompletionCall,
    completion_calls,
    completion_payload,
    logprob_capabilities,
    parse_completion,
    refusal,
)
from workers.errors import ContractViolation
from workers.rows.table import RowContext, build_table


def parse(name: str, request: RolloutRequest, response: dict[str, Any] | None = None) -> list[SampleOutput]:
    [call] = completion_calls(request, rid_prefix="r")
    return parse_completion(call, response if response is not None else fixture(name)["response"])


def rows(request: RolloutRequest, samples: list[SampleOutput]) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    ctx = RowContext(run="r", job_id="j", engine="vllm-http", model="m", worker_id="w", weight_version=0,
                     submitted_at=now, started_at=now, finished_at=now)
    return build_table([request], [samples], ctx).to_pylist()


def choice(name: str) -> dict[str, Any]:
    return fixture(name)["response"]["choices"][0]


# -- requests -> bodies ----------------------------------------------------------------------


def test_a_greedy_request_sends_token_ids_and_every_sampling_field() -> None:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 5, "temperature": 0.0, "stop": ["\n\n", "token_id:576"], "stop_token_ids": [7],
        "min_new_tokens": 2, "skip_special_tokens": False}})
    [call] = completion_calls(request, rid_prefix="r")
    assert call.payload == {
        "request_id": "r", "prompt": [1, 2, 3], "return_token_ids": True, "max_tokens": 5, "min_tokens": 2,
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "n": 1,
        "stop": ["\n\n", "token_id:576"],  # a `token_id:N` literal stays a string
        "stop_token_ids": [7], "include_stop_str_in_output": False, "ignore_eos": False,
        "skip_special_tokens": False, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "logprobs": 0, "return_tokens_as_token_ids": True,
    }
    assert call.vllm_ids == ["cmpl-r-0"]  # the id vLLM's /abort_requests takes


def test_token_id_stops_no_stop_trim_and_prompt_logprobs_map_onto_vllm_fields() -> None:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": [1], "logprobs": None, "prompt_logprobs": 0,
                                             "sampling_params": {"stop": [32, 34], "no_stop_trim": True,
                                                                 "top_k": 20, "temperature": 0.7}})
    payload = completion_payload(request, rid="r", n=1, seed=None)
    assert payload["stop"] == [] and payload["stop_token_ids"] == [32, 34]
    assert payload["include_stop_str_in_output"] is True
    assert payload["top_k"] == 20 and payload["temperature"] == 0.7
    assert payload["prompt_logprobs"] == 0 and "logprobs" not in payload and "seed" not in payload


def test_seeded_samples_are_one_call_each_with_the_seed_every_engine_derives() -> None:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": [1], "sampling_params": {"n": 3, "seed": 7}})
    calls = completion_calls(request, rid_prefix="r")
    assert [(c.rid, c.samples, c.first_sample, c.payload["seed"], c.payload["n"]) for c in calls] == [
        (f"r-s{i}", 1, i, sample_seed(7, i), 1) for i in range(3)]
    unseeded = completion_calls(RolloutRequest.model_validate({"id": "q", "input_ids": [1],
                                                               "sampling_params": {"n": 3}}), rid_prefix="r")
    assert [(c.samples, "seed" in c.payload) for c in unseeded] == [(3, False)]


def test_a_continuation_is_one_sample_under_its_continuation_seed() -> None:
    request = ContinuedRequest.model_validate({"id": "q", "input_ids": [1, 2, 9, 9], "generated": 2,
                                               "sample_index": 1, "sampling_params": {"n": 1, "seed": 7}})
    [call] = completion_calls(request)
    assert call.rid.startswith("q+2-") and call.payload["seed"] == continuation_seed(7, 1, 2)
    assert call.payload["prompt"] == [1, 2, 9, 9]


def test_max_new_tokens_0_asks_for_one_token_and_keeps_none() -> None:
    request = request_of("completion_top_logprobs", sampling={"max_new_tokens": 0})
    [call] = completion_calls(request, rid_prefix="r")
    assert call.payload["max_tokens"] == 1 and call.drop_output
    [sample] = parse_completion(call, fixture("completion_top_logprobs")["response"])
    assert sample.token_ids.tolist() == [] and sample.finish == Finish("length") and sample.text == ""
    assert sample.logprobs is not None and len(sample.logprobs) == 0 and sample.top_logprobs == []
    assert sample.prompt_logprobs is not None and sample.prompt_logprobs[0] is None


# -- answers -> samples -> rows (the stop contract) ----------------------------------------------


def test_eos_stop_keeps_the_eos_id_and_names_no_stop_reason() -> None:
    request = request_of("completion_eos")
    [sample] = parse("completion_eos", request)
    recorded = choice("completion_eos")
    assert sample.token_ids.tolist() == recorded["token_ids"] and sample.token_ids[-1] == 2  # <|im_end|>
    assert sample.finish == Finish("stop", matched=None)
    assert sample.logprobs is not None
    np.testing.assert_allclose(sample.logprobs, recorded["logprobs"]["token_logprobs"], rtol=0, atol=1e-6)
    [row] = rows(request, [sample])
    assert row["finish_reason"] == "stop" and row["stop_reason_token"] is None and row["stop_reason_text"] is None
    assert row["completion_token_ids"] == recorded["token_ids"]
    assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])


def test_a_user_stop_id_that_is_also_the_eos_is_named_although_vllm_reports_null() -> None:
    request = request_of("completion_eos", sampling={"stop_token_ids": [2]})
    [sample] = parse("completion_eos", request)
    assert sample.finish == Finish("stop", matched=2)
    assert rows(request, [sample])[0]["stop_reason_token"] == 2


@pytest.mark.parametrize("name", ["completion_stop_string", "completion_stop_string_included"])
def test_a_stop_string_keeps_the_ids_verbatim_and_trims_the_text_as_asked(name: str) -> None:
    request = request_of(name)
    [sample] = parse(name, request)
    recorded = choice(name)
    assert sample.finish == Finish("stop", matched=" Paris")
    assert sample.token_ids.tolist() == recorded["token_ids"]  # the token completing " Paris" included
    [row] = rows(request, [sample])
    assert row["stop_reason_text"] == " Paris" and row["stop_reason_token"] is None
    # no_stop_trim (vLLM's include_stop_str_in_output) keeps the stop string; else it is trimmed.
    included = request.sampling_params.no_stop_trim
    assert row["completion_text"] == ("The capital of France is Paris" if included else "The capital of France is")


def test_a_stop_token_id_is_the_integer_stop_reason_and_stays_in_the_ids() -> None:
    request = request_of("completion_stop_token_id")
    [sample] = parse("completion_stop_token_id", request)
    assert sample.finish == Finish("stop", matched=4649) and sample.token_ids[-1] == 4649
    [row] = rows(request, [sample])
    assert row["stop_reason_token"] == 4649 and row["finish_reason"] == "stop"


def test_length_and_ignore_eos_finish_by_length() -> None:
    for name in ("completion_length", "completion_ignore_eos_min_tokens"):
        request = request_of(name)
        [sample] = parse(name, request)
        assert sample.finish == Finish("length")
        assert len(sample.token_ids) == request.sampling_params.max_new_tokens


def test_each_of_n_samples_is_its_own_row_with_its_own_finish() -> None:
    request = request_of("completion_n2_seed")
    body = fixture("completion_n2_seed")["response"]
    call = CompletionCall(request, "r", {}, samples=2)
    samples = parse_completion(call, body)
    assert [s.token_ids.tolist() for s in samples] == [c["token_ids"] for c in body["choices"]]
    # One sample stopped, the other ran out of budget: each row says its own.
    body = copy.deepcopy(body)
    body["choices"][1].update(finish_reason="stop", stop_reason=None)
    body["choices"].reverse()  # answered out of order: `index` decides
    samples = parse_completion(call, body)
    assert [s.finish.kind for s in samples] == ["length", "stop"]
    assert [r["finish_reason"] for r in rows(request, samples)] == ["length", "stop"]


def test_top_k_alternatives_by_token_id_best_first_and_prompt_logprobs_null_at_0() -> None:
    request = request_of("completion_top_logprobs")
    [sample] = parse("completion_top_logprobs", request)
    recorded = choice("completion_top_logprobs")
    assert sample.top_logprobs is not None and len(sample.top_logprobs) == len(sample.token_ids)
    assert sample.top_logprobs[0] == [(504, pytest.approx(-1.8827067613601685)),
                                      (60, pytest.approx(-1.9648066759109497))]
    for position, alternatives in enumerate(sample.top_logprobs):
        assert [lp for _, lp in alternatives] == sorted((lp for _, lp in alternatives), reverse=True)
        assert len(alternatives) == 2 and alternatives[0][0] == sample.token_ids[position]  # greedy: the best
    prompt = request.input_ids
    assert sample.prompt_logprobs is not None and len(sample.prompt_logprobs) == len(prompt)
    assert sample.prompt_logprobs[0] is None
    assert sample.prompt_logprobs[1:] == [pytest.approx(recorded["prompt_logprobs"][i][str(prompt[i])]["logprob"])
                                         for i in range(1, len(prompt))]
    [row] = rows(request, [sample])
    assert row["prompt_logprobs"][0] is None and row["completion_top_logprobs"][0][1]["token_id"] == 60


def test_a_sampled_token_outside_the_top_k_is_not_one_of_the_alternatives() -> None:
    request = request_of("completion_top_logprobs", logprobs=1, prompt_logprobs=None)
    body = copy.deepcopy(fixture("completion_top_logprobs")["response"])
    position = body["choices"][0]["logprobs"]["top_logprobs"]
    chosen = body["choices"][0]["token_ids"][0]
    # vLLM lists the sampled token first, then the top k: k + 1 entries when it is not among them.
    position[0] = {f"token_id:{chosen}": -3.0, "token_id:60": -0.5}
    for i in range(1, len(position)):
        position[i] = dict(list(position[i].items())[:1])
    [sample] = parse("", request, body)
    assert sample.top_logprobs is not None and sample.top_logprobs[0] == [(60, -0.5)]


def test_an_aborted_completion_keeps_what_it_generated() -> None:
    request = request_of("completion_aborted")
    [sample] = parse("completion_aborted", request)
    generated = choice("completion_aborted")["token_ids"]
    assert 0 < len(generated) < request.sampling_params.max_new_tokens  # stopped partway
    assert sample.finish.kind == "abort" and sample.token_ids.tolist() == generated
    assert sample.logprobs is not None and len(sample.logprobs) == len(generated)


def test_answers_that_break_an_invariant_are_contract_violations() -> None:
    request = request_of("completion_top_logprobs")
    good = fixture("completion_top_logprobs")["response"]

    def broken(change: Any) -> dict[str, Any]:
        body = copy.deepcopy(good)
        change(body["choices"][0])
        return body

    with pytest.raises(ContractViolation, match="other token ids"):
        parse("", request, broken(lambda c: c["logprobs"]["tokens"].reverse()))
    with pytest.raises(ContractViolation, match="prompt_token_ids differ"):
        parse("", request, broken(lambda c: c["prompt_token_ids"].append(5)))
    with pytest.raises(ContractViolation, match="token_ids is missing"):
        parse("", request, broken(lambda c: c.pop("token_ids")))
    with pytest.raises(ContractViolation, match="finish_reason 'error'"):
        parse("", request, broken(lambda c: c.update(finish_reason="error")))
    with pytest.raises(ContractViolation, match="prompt_logprobs\\[0\\] is not null"):
        parse("", request, broken(lambda c: c["prompt_logprobs"].__setitem__(0, {"1": {"logprob": 0.0}})))
    with pytest.raises(ContractViolation, match="2 choices for 1 samples"):
        body = copy.deepcopy(good)
        body["choices"].append(copy.deepcopy(body["choices"][0]) | {"index": 1})
        parse("", request, body)
    # Without return_tokens_as_token_ids the alternatives are keyed by text, which can collide: refused.
    with pytest.raises(ContractViolation, match="return_tokens_as_token_ids"):
        parse("completion_top_logprobs_text_keys", request_of("completion_top_logprobs_text_keys"))


# -- which requests each logprobs mode serves exactly ------------------------------------------


def asks(logprobs: int | None = 0, prompt_logprobs: int | None = None, **sampling: Any) -> RolloutRequest:
    return RolloutRequest.model_validate({"id": "q", "input_ids": [1], "logprobs": logprobs,
                                          "prompt_logprobs": prompt_logprobs, "sampling_params": sampling})


def lacks(request: RolloutRequest, mode: str) -> list[str]:
    """What a worker in front of a vLLM server in `mode` says it cannot serve of `request`."""
    return missing(needs_of(request), Capabilities(max_top_logprobs=5, **logprob_capabilities(mode)))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_and_temperature_1_are_served_in_either_logprobs_mode(mode: str) -> None:
    assert lacks(asks(temperature=0.0), mode) == []
    assert lacks(asks(temperature=0.0, top_k=5, prompt_logprobs=0), mode) == []
    assert lacks(asks(logprobs=3, temperature=1.0, prompt_logprobs=0), mode) == []
    assert lacks(asks(logprobs=None, temperature=0.7, top_k=5), mode) == []  # no logprobs: anything goes
    assert refusal(asks(temperature=0.7, top_k=5), mode) is None


def test_a_raw_logprobs_server_lacks_what_its_logprobs_do_not_show() -> None:
    assert lacks(asks(temperature=0.7), "raw_logprobs") == ["logprobs at a temperature other than 0 or 1"]
    assert lacks(asks(temperature=1.0, frequency_penalty=0.5), "raw_logprobs") == [
        "logprobs with frequency/presence penalties or min_new_tokens"]
    assert lacks(asks(temperature=0.0, min_new_tokens=3), "raw_logprobs") == [
        "logprobs with frequency/presence penalties or min_new_tokens"]
    # Raw logprobs are taken before top-k/top-p/min-p, as the contract's: served at temperature 1.
    assert lacks(asks(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1), "raw_logprobs") == []


def test_a_processed_logprobs_server_lacks_filtered_sampling_it_renormalises() -> None:
    assert lacks(asks(temperature=0.7, top_k=5), "processed_logprobs") == [
        "logprobs of top-k/top-p/min-p filtered sampling"]
    assert lacks(asks(temperature=1.0, top_p=0.9), "processed_logprobs") != []
    assert lacks(asks(temperature=1.0, min_p=0.1), "processed_logprobs") != []
    assert lacks(asks(temperature=0.7, frequency_penalty=0.5, min_new_tokens=2), "processed_logprobs") == []


def test_what_no_mode_serves_exactly_is_refused_everywhere() -> None:
    for mode in ("raw_logprobs", "processed_logprobs"):
        assert lacks(asks(logprobs=None, prompt_logprobs=0, temperature=0.7), mode) == [
            "prompt logprobs at a temperature other than 0 or 1"]
        assert lacks(asks(logprobs=None, repetition_penalty=1.1), mode) == [
            "repetition_penalty (over generated tokens only, as SGLang)"]
        assert "greedily below" in (refusal(asks(logprobs=None, temperature=5e-6), mode) or "")
    for mode in ("raw_logits", "processed_logits"):
        assert "not logprobs" in (refusal(asks(temperature=0.0), mode) or "")
        assert refusal(asks(logprobs=None, temperature=0.7), mode) is None
