"""The stop and logprob contracts as a table, run on the hf engine with a scripted model.

The scripted model (tests/conftest.py SCRIPT) follows a→b→c→d→{e→EOS | x→y→x…},
h→e→EOS, H→i→EOS, !→!→…, so every case's exact output is known in advance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.errors import RequestFileError
from pipeline.submit.request_file import parse_lines
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from tests.helpers.invariants import assert_row_invariants
from tests.helpers.models import token_id
from workers.engines.base import Finish
from workers.engines.hf.engine import HFEngine
from workers.engines.request_support import check_request_supported
from workers.errors import ContractViolation, UnsupportedRequestError
from workers.rows.contracts import resolve_finish
from workers.rows.table import RowContext, build_table


@dataclass
class Case:
    prompt: str
    params: dict[str, Any]
    completion: str  # expected completion characters ("<" stands for EOS)
    finish: str
    stop_text: str | None = None
    stop_token: int | None = None
    text: str | None = None  # expected completion_text, when it differs from the completion
    extra: dict[str, Any] = field(default_factory=dict)


EOS = token_id("<eos>")
CASES: dict[str, Case] = {
    "string stop matched, trimmed from text only": Case("a", {"stop": "cd"}, "bcd", "stop", stop_text="cd", text="b"),
    "string stop kept with no_stop_trim": Case("a", {"stop": "cd", "no_stop_trim": True}, "bcd", "stop",
                                               stop_text="cd", text="bcd"),
    "list of strings, the one that matched": Case("x", {"stop": ["zz", "xy"]}, "yxy", "stop", stop_text="xy",
                                                  text="y"),
    "token-id stops [c, d] stop on either, token text trimmed": Case(
        "a", {"stop": [token_id("c"), token_id("d")]}, "bc", "stop", stop_token=token_id("c"), text="b"),
    "stop_token_ids merge with stop ids": Case("a", {"stop_token_ids": [token_id("d")]}, "bcd", "stop",
                                               stop_token=token_id("d"), text="bc"),
    "token stop text kept with no_stop_trim": Case("a", {"stop": [token_id("c")], "no_stop_trim": True}, "bc",
                                                   "stop", stop_token=token_id("c"), text="bc"),
    "token_id:576 is a literal string": Case("!", {"stop": "token_id:576", "max_new_tokens": 5}, "!!!!!", "length"),
    "token_id:576 in a list is a literal string": Case("!", {"stop": ["token_id:576"], "max_new_tokens": 4},
                                                       "!!!!", "length"),
    "EOS stops with null stop_reason, EOS kept in ids": Case("h", {}, "e<", "stop", text="e"),
    "user-listed EOS id is the stop_reason": Case("h", {"stop": [EOS]}, "e<", "stop", stop_token=EOS, text="e"),
    "hidden stop id not listed stays null": Case("H", {"stop": [token_id("z")]}, "i<", "stop", text="i"),
    "max_new_tokens reached is length": Case("!", {"max_new_tokens": 3}, "!!!", "length"),
    "ignore_eos runs past EOS to length": Case("h", {"ignore_eos": True, "max_new_tokens": 3}, "e<<", "length",
                                               text="e"),
    "ignore_eos disables user token stops too": Case("h", {"ignore_eos": True, "stop": [token_id("e")],
                                                           "max_new_tokens": 2}, "e<", "length", text="e"),
    "string stop checked before token stop": Case("a", {"stop": "c", "stop_token_ids": [token_id("c")]}, "bc",
                                                  "stop", stop_text="c", text="b"),
    "stop string inside one sampled run": Case("!", {"stop": "!!!", "max_new_tokens": 10}, "!!!", "stop",
                                               stop_text="!!!", text=""),
    "sampling at temperature 1 follows the script": Case("a", {"temperature": 1.0, "stop": "d"}, "bcd", "stop",
                                                         stop_text="d", text="bc"),
}


@pytest.fixture(scope="module")
def engine(scripted_model_dir: Path) -> HFEngine:
    return HFEngine(scripted_model_dir, max_top_logprobs=3)


def run_rows(engine: HFEngine, requests: list[RolloutRequest]) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    ctx = RowContext(run="r", job_id="j", engine="hf", model="scripted", worker_id="w", weight_version=0,
                     submitted_at=now, started_at=now, finished_at=now)
    return build_table(requests, engine.generate(requests), ctx).to_pylist()


def chars(ids: list[int]) -> str:
    from tests.helpers.models import CHARS

    return "".join("<" if i == EOS else CHARS[i - 1] for i in ids)


@pytest.mark.parametrize("name", list(CASES))
def test_contract_table(engine: HFEngine, name: str) -> None:
    case = CASES[name]
    line = {
        "id": "q",
        "input_ids": [token_id(case.prompt)],
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, **case.params},
        "logprobs": 3,
        "prompt_logprobs": 0,
    }
    request = RolloutRequest.model_validate(line)
    [row] = run_rows(engine, [request])
    assert_row_invariants(row, line)
    assert chars(row["completion_token_ids"]) == case.completion
    assert row["finish_reason"] == case.finish
    assert row["stop_reason_text"] == case.stop_text
    assert row["stop_reason_token"] == case.stop_token
    expected_text = case.text if case.text is not None else case.completion.replace("<", "")
    assert row["completion_text"] == expected_text


def test_n_samples_each_get_their_own_finish(engine: HFEngine) -> None:
    # From d the script branches with equal odds: e→EOS (stop, null reason) or x→y→x (stop string "yx").
    line = {"id": "g", "input_ids": [token_id("c")], "logprobs": 0,
            "sampling_params": {"n": 8, "seed": 5, "temperature": 1.0, "stop": "yx", "max_new_tokens": 12}}
    rows = run_rows(engine, [RolloutRequest.model_validate(line)])
    assert [r["sample_index"] for r in rows] == list(range(8))
    assert len({r["rollout_id"] for r in rows}) == 8
    outcomes = Counter()
    for row in rows:
        assert_row_invariants(row, line)
        text = chars(row["completion_token_ids"])
        if text == "de<":
            assert (row["finish_reason"], row["stop_reason_text"], row["stop_reason_token"]) == ("stop", None, None)
            outcomes["eos"] += 1
        else:
            assert text == "dxyx"
            assert (row["finish_reason"], row["stop_reason_text"], row["completion_text"]) == ("stop", "yx", "dx")
            outcomes["string"] += 1
    assert outcomes["eos"] and outcomes["string"], outcomes


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (576, "bare number"),
        ([1, "a"], "mixes strings and token ids"),
        (True, "not a bool"),
        ([-1], "negative"),
        ("", "empty stop string"),
    ],
)
def test_rejected_stop_forms_name_the_line(stop: object, message: str) -> None:
    import json

    lines = [json.dumps({"id": "ok", "input_ids": [1]}),
             json.dumps({"id": "bad", "input_ids": [1], "sampling_params": {"stop": stop}})]
    with pytest.raises(RequestFileError) as info:
        parse_lines(lines, path="f.jsonl")
    [error] = info.value.errors
    assert (error.line, error.field) == (2, "sampling_params.stop")
    assert message in error.message


def test_token_id_beyond_vocabulary_is_rejected_when_known() -> None:
    import json

    lines = [json.dumps({"id": "a", "input_ids": [1], "sampling_params": {"stop": [70]}})]
    expected = r"f\.jsonl:1: input_ids: token id 70 is outside the model's vocabulary of 64"
    with pytest.raises(RequestFileError, match=expected):
        parse_lines(lines, path="f.jsonl", vocab_size=64)


def test_top_k_is_gated_by_the_engines_capabilities() -> None:
    request = RolloutRequest(id="a", input_ids=[1], logprobs=4)
    with pytest.raises(UnsupportedRequestError, match=r"top-4 logprobs \(start a worker with --max-top-logprobs 4\)"):
        check_request_supported(request, Capabilities(max_top_logprobs=0))
    check_request_supported(request, Capabilities(max_top_logprobs=4))
    with pytest.raises(UnsupportedRequestError, match="cannot serve stop strings"):
        check_request_supported(RolloutRequest(id="a", input_ids=[1], sampling_params={"stop": "x"}),
                                Capabilities(stop_strings=False))


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        (Finish("stop", matched=7), ("stop", None, 7)),
        (Finish("stop", matched=2), ("stop", None, None)),  # EOS / hidden id, not the user's
        (Finish("stop", matched="\n\n"), ("stop", "\n\n", None)),
        (Finish("length"), ("length", None, None)),
        (Finish("abort", message="client gone"), ("abort", None, None)),
    ],
)
def test_resolve_finish_shapes(finish: Finish, expected: tuple) -> None:
    request = RolloutRequest(id="a", input_ids=[1], sampling_params={"stop": ["\n\n"], "stop_token_ids": [7]})
    outcome = resolve_finish(request, finish)
    assert (outcome.finish_reason, outcome.stop_reason_text, outcome.stop_reason_token) == expected


def test_unknown_finish_and_foreign_stop_string_are_violations() -> None:
    request = RolloutRequest(id="a", input_ids=[1], sampling_params={"stop": "x"})
    with pytest.raises(ContractViolation, match="unknown finish type"):
        resolve_finish(request, Finish("timeout"))  # type: ignore[arg-type]
    with pytest.raises(ContractViolation, match="not one of the request's stops"):
        resolve_finish(request, Finish("stop", matched="y"))
