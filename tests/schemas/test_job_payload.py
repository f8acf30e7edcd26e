"""Job payloads: compact token ids, a JSON round trip, re-validation in the worker."""

from __future__ import annotations

import json

import numpy as np
import pytest

from schemas.job_payload import JobPayload, pack_token_ids, unpack_token_ids
from schemas.request import RolloutRequest


def _requests() -> list[RolloutRequest]:
    return [
        RolloutRequest(id="a", input_ids=[1, 2, 3], sampling_params={"n": 2, "stop": [7]}, metadata={"k": [1]}),
        RolloutRequest(id="b", input_ids=[2**31 - 1, 0], routing_key="session-7"),
    ]


def test_round_trip_through_json() -> None:
    requests = _requests()
    payload = JobPayload.pack(requests, run="r", job_id="j", batch_id="b", output="memory://o",
                              submitted_at_ms=1)
    wire = json.dumps(payload.model_dump(mode="json"))
    again = JobPayload.model_validate(json.loads(wire)).unpack()
    assert again == requests


def test_token_ids_are_packed_compactly() -> None:
    prompts = [list(range(100_000, 100_512))] * 4
    packed, lengths = pack_token_ids(prompts)
    assert lengths == [512] * 4
    # base64 of int32: 16/3 bytes a token, against ~7 for a JSON list of 6-digit numbers.
    assert len(packed) <= 2048 * 16 / 3 + 4
    assert [a.tolist() for a in unpack_token_ids(packed, lengths)] == prompts


def test_tampered_payload_is_refused() -> None:
    payload = JobPayload.pack(_requests(), run="r", job_id="j", batch_id="b", output="o", submitted_at_ms=1)
    data = payload.model_dump(mode="json")
    data["prompt_lengths"] = [3, 3]
    with pytest.raises(ValueError, match="packed token ids"):
        JobPayload.model_validate(data).unpack()
    data = payload.model_dump(mode="json")
    data["requests"][0]["sampling_params"]["n"] = True
    with pytest.raises(ValueError):
        JobPayload.model_validate(data).unpack()
    assert np.array_equal(unpack_token_ids(*pack_token_ids([[5]]))[0], [5])
