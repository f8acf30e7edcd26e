"""Request errors that teach: counted by line, "did you mean", the missing tokenizer, Python indices."""

from __future__ import annotations

import json

import pytest

import pipeline
from pipeline.submit.request_file import parse_lines

ID = {"id": "q", "input_ids": [1, 2]}


def _errors(lines: list[dict]) -> pipeline.RequestFileError:
    with pytest.raises(pipeline.RequestFileError) as info:
        parse_lines([json.dumps({**line, "id": f"q{i}"}) for i, line in enumerate(lines)], path="f.jsonl")
    return info.value


def test_invalid_lines_are_counted_as_lines_not_errors() -> None:
    error = _errors([{**ID, "bogus": 1, "sampling_params": {"top_pp": 1, "temprature": 1}}, ID,
                     {**ID, "input_ids": [-1], "logprob": 2}])
    assert str(error).startswith("f.jsonl: 2 invalid line(s) (5 problems); nothing was enqueued.")
    assert len(error.errors) == 5 and {e.line for e in error.errors} == {1, 3}


@pytest.mark.parametrize(("line", "expected"), [
    ({**ID, "sampling_params": {"temprature": 0.5}}, "f.jsonl:1: sampling_params.temprature: unknown field; "
                                                     "did you mean 'temperature'?"),
    ({**ID, "sampling_params": {"max_tokens": 5}}, "f.jsonl:1: sampling_params.max_tokens: unknown field; "
                                                   "did you mean 'max_new_tokens'?"),
    ({**ID, "sampling_params": {"stop_sequences": ["x"]}}, "did you mean 'stop'?"),
    ({**ID, "logprob": 2}, "f.jsonl:1: logprob: unknown field; did you mean 'logprobs'?"),
    ({**ID, "temperature": 0.5}, "f.jsonl:1: temperature: unknown field: sampling parameters go inside "
                                 "\"sampling_params\" ({\"sampling_params\": {\"temperature\": ...}})"),
    ({**ID, "max_tokens": 5}, "{\"sampling_params\": {\"max_new_tokens\": ...}}"),
    ({**ID, "wibble": 5}, "f.jsonl:1: wibble: unknown field (check its spelling against the request schema)"),
])
def test_unknown_fields_name_the_field_meant(line: dict, expected: str) -> None:
    assert expected in str(_errors([line]))


@pytest.mark.parametrize("field", ["messages", "prompt"])
def test_a_chat_or_prompt_line_without_a_tokenizer_says_to_pass_one(field: str) -> None:
    value = [{"role": "user", "content": "hi"}] if field == "messages" else "hi"
    error = _errors([{"id": "x", field: value}])
    [only] = error.errors  # not also "input_ids: required field is missing"
    assert only.field == field and "needs a tokenizer to render it into input_ids: pass --tokenizer PATH" \
        in only.message


def test_the_python_api_names_entries_by_index(redis_client: object) -> None:
    client = pipeline.Client(redis_client)  # type: ignore[arg-type]
    with pytest.raises(pipeline.RequestFileError) as info:
        client.submit([ID, {"id": "b"}, {**ID, "id": "c", "bogus": 1}], run="api", output="memory://x")
    text = str(info.value)
    assert text.startswith("requests: 2 invalid entries; nothing was enqueued.")
    assert "  requests[1]: input_ids: required field is missing" in text
    assert "  requests[2]: bogus: unknown field" in text
