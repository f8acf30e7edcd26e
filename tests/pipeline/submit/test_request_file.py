"""Request errors that teach: counted by line, "did you mean", the missing tokenizer, Python indices."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

import pipeline
from pipeline.submit.request_file import ParsedRequest, parse_lines
from schemas.job_payload import JobPayload
from schemas.request import MAX_PROMPT_TOKENS, RolloutRequest

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


HEADER = {"run": "r", "job_id": "j", "batch_id": "j", "output": "file:///tmp/x", "submitted_at_ms": 1}
FIELDS = {"id": "s:1", "sampling_params": {"max_new_tokens": 8, "temperature": 0.5}, "logprobs": 2,
          "metadata": {"k": 1}, "prompt_text": "text", "routing_key": "s", "adapter": "sql"}


def test_a_request_checked_as_an_array_makes_the_job_the_model_makes() -> None:
    """`pipeline serve`'s turn: the ids stay an array, and the job is the one a validated model gives."""
    ids = np.arange(5, 2005, dtype="<i4")
    by_array = ParsedRequest.of_array(FIELDS, ids)
    by_model = RolloutRequest.model_validate({**FIELDS, "input_ids": ids.tolist()})
    assert JobPayload.pack([by_array], **HEADER) == JobPayload.pack([by_model], **HEADER)
    assert JobPayload.pack([by_array], **HEADER).unpack() == [by_model]
    assert (by_array.adapter, by_array.max_token_id()) == ("sql", 2004)


@pytest.mark.parametrize("ids", [[], [3, -1], [1] * (MAX_PROMPT_TOKENS + 1)], ids=["empty", "negative", "too long"])
def test_ids_the_model_refuses_are_refused_with_its_own_error(ids: list[int]) -> None:
    with pytest.raises(ValidationError) as error:
        ParsedRequest.of_array(FIELDS, np.asarray(ids, dtype="<i4"))
    assert error.value.errors()[0]["loc"][0] == "input_ids"
