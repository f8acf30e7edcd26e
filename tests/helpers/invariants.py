"""Row invariants every test checks on every row it produces."""

from __future__ import annotations

import math
from typing import Any


def assert_row_invariants(row: dict[str, Any], request: dict[str, Any] | None = None) -> None:
    completion = row["completion_token_ids"]
    assert row["completion_tokens"] == len(completion)
    assert row["prompt_tokens"] == len(row["prompt_token_ids"])
    assert row["finish_reason"] in {"stop", "length", "abort"}
    if row["stop_reason_text"] is not None or row["stop_reason_token"] is not None:
        assert row["finish_reason"] == "stop"
    if row["completion_logprobs"] is not None:
        assert len(row["completion_logprobs"]) == len(completion)
        assert all(lp <= 1e-4 and not math.isnan(lp) for lp in row["completion_logprobs"])
    tops = row["completion_top_logprobs"]
    if tops is not None:
        assert len(tops) == len(completion)
        k = len(tops[0]) if tops else 0
        for token, chosen, alternatives in zip(completion, row["completion_logprobs"], tops, strict=True):
            values = [a["logprob"] for a in alternatives]
            assert len(alternatives) == k and values == sorted(values, reverse=True)
            ids = [a["token_id"] for a in alternatives]
            if token in ids:
                assert abs(values[ids.index(token)] - chosen) < 1e-5
    if row["prompt_logprobs"] is not None:
        assert len(row["prompt_logprobs"]) == len(row["prompt_token_ids"])
        assert row["prompt_logprobs"][0] is None
    if request is not None:
        assert row["prompt_token_ids"] == request["input_ids"]
        assert row["request_id"] == request["id"]
        params = request.get("sampling_params", {})
        assert len(completion) <= params.get("max_new_tokens", 128)
        assert abs(row["temperature"] - params.get("temperature", 1.0)) < 1e-6
        assert row["seed"] == params.get("seed")
        assert row["max_new_tokens"] == params.get("max_new_tokens", 128)
        import json

        assert json.loads(row["metadata"]) == request.get("metadata", {})
