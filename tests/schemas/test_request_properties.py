"""Property tests: valid request lines round-trip through a job payload; invalid ones are located."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import RequestFileError
from pipeline.request_file import parse_lines
from schemas.job_payload import JobPayload
from schemas.request import MAX_TOKEN_ID

token_ids = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=40)
stops = st.one_of(
    st.none(),
    st.text(min_size=1, max_size=5),
    st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3),
    st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=3),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
valid_lines = st.fixed_dictionaries(
    {"id": st.text(min_size=1, max_size=12), "input_ids": token_ids},
    optional={
        "sampling_params": st.fixed_dictionaries(
            {},
            optional={
                "max_new_tokens": st.integers(0, 4096),
                "temperature": st.floats(0, 2, allow_nan=False),
                "top_p": st.floats(0.01, 1, allow_nan=False),
                "top_k": st.sampled_from([-1, 1, 5, 50]),
                "n": st.integers(1, 8),
                "seed": st.integers(0, 2**63 - 1),
                "stop": stops,
                "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
                "ignore_eos": st.booleans(),
            },
        ),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "prompt_logprobs": st.sampled_from([None, 0]),
        "metadata": st.dictionaries(st.text(max_size=6), json_values, max_size=4),
    },
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_lines, min_size=1, max_size=5, unique_by=lambda line: line["id"]))
def test_valid_lines_round_trip_through_a_job(lines: list[dict]) -> None:
    requests = parse_lines([json.dumps(line) for line in lines], path="p.jsonl")
    payload = JobPayload.pack(requests, run="r", job_id="j", batch_id="b", output="o", submitted_at_ms=0)
    wire = json.loads(json.dumps(payload.model_dump(mode="json")))
    assert JobPayload.model_validate(wire).unpack() == requests
    assert [r.input_ids for r in requests] == [line["input_ids"] for line in lines]


FIELDS = ["id", "input_ids", "sampling_params", "logprobs", "prompt_logprobs", "metadata", "unknown"]


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FIELDS), json_values), max_size=4), st.integers(1, 3))
def test_any_line_is_accepted_or_refused_with_its_line_number(fields: list[tuple[str, object]], position: int) -> None:
    line = {"id": "x", "input_ids": [1]}
    line.update(dict(fields))
    lines = [json.dumps({"id": f"ok{i}", "input_ids": [1]}) for i in range(position - 1)] + [json.dumps(line)]
    try:
        parse_lines(lines, path="p.jsonl")
    except RequestFileError as exc:
        assert exc.errors and all(e.line == position for e in exc.errors)
        assert all(str(e).startswith(f"p.jsonl:{position}: ") for e in exc.errors)
