"""Property tests: valid request lines round-trip through a job payload; invalid ones are located."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import RequestFileError
from pipeline.submit.request_file import parse_lines
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


# Values each field must accept and values it must refuse, so every generated line has a verdict
# known in advance (any JSON under an unknown field is refused).
ACCEPTED: dict[str, list[object]] = {
    "id": ["q1", "x" * 512, "é"],
    "input_ids": [[0], [1, 2, 3], [MAX_TOKEN_ID]],
    "sampling_params": [{}, {"n": 2, "temperature": 0}, {"stop": ["a"], "top_k": 5}],
    "logprobs": [None, 0, 5, 1024],
    "prompt_logprobs": [None, 0],
    "metadata": [{}, {"a": [1, None, "x"]}, {"nested": {"k": True}}],
}
REFUSED: dict[str, list[object]] = {
    "id": ["", 5, None, ["q"], "x" * 513],
    "input_ids": [[], [-1], ["1"], [True], [MAX_TOKEN_ID + 1], 3, [1.5], None],
    "sampling_params": [{"bogus": 1}, {"n": 0}, {"top_k": 0}, {"temperature": -1}, "greedy", [1], {"stop": 5}],
    "logprobs": [-1, True, "1", 1.5, 1025],
    "prompt_logprobs": [1, True, "0", -1],
    "metadata": ["x", [1], 3],
}
field_values = st.one_of(
    *[st.tuples(st.just(f), st.sampled_from(v), st.just(True)) for f, v in ACCEPTED.items()],
    *[st.tuples(st.just(f), st.sampled_from(v), st.just(False)) for f, v in REFUSED.items()],
    st.tuples(st.just("unknown"), json_values, st.just(False)),
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(field_values, max_size=4, unique_by=lambda t: t[0]), st.integers(1, 3))
def test_a_line_is_accepted_or_refused_as_its_fields_say_with_its_line_number(
    fields: list[tuple[str, object, bool]], position: int
) -> None:
    line: dict[str, object] = {"id": "x", "input_ids": [1]}
    line.update({field: value for field, value, _ in fields})
    valid = all(ok for _, _, ok in fields)
    lines = [json.dumps({"id": f"ok{i}", "input_ids": [1]}) for i in range(position - 1)] + [json.dumps(line)]
    try:
        requests = parse_lines(lines, path="p.jsonl")
    except RequestFileError as exc:
        assert not valid, f"a valid line was refused: {line}: {exc}"
        assert exc.errors and all(e.line == position for e in exc.errors)
        assert all(str(e).startswith(f"p.jsonl:{position}: ") for e in exc.errors)
        named = {field for field, _, ok in fields if not ok}
        assert any(any(f in str(e) for f in named) for e in exc.errors), (named, str(exc))
    else:
        assert valid, f"an invalid line was accepted: {line}"
        assert requests[-1].id == line["id"] and requests[-1].input_ids == line["input_ids"]
