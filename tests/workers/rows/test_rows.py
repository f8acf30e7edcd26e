"""Rows: per-token weight versions as run-length segments; a single-version row as before."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.errors import ContractViolation
from workers.rows.table import RowContext, build_table

NOW = datetime.now(UTC)
CTX = RowContext(run="run", job_id="job", engine="sim", model="m", worker_id="w", weight_version=3,
                 submitted_at=NOW, started_at=NOW, finished_at=NOW)


def sample(tokens: int, **fields: object) -> SampleOutput:
    return SampleOutput(token_ids=np.arange(1, tokens + 1, dtype=np.int32), finish=Finish("length"),
                        logprobs=np.full(tokens, -0.5, dtype=np.float32), **fields)  # type: ignore[arg-type]


def test_segments_are_stored_and_weight_version_is_the_oldest() -> None:
    requests = [RolloutRequest(id="a", input_ids=[1]), RolloutRequest(id="b", input_ids=[1])]
    outputs = [[sample(5, version_segments=[(0, 3), (2, 4)])], [sample(4, weight_version=3)]]
    rows = build_table(requests, outputs, CTX).to_pylist()
    assert rows[0]["weight_version"] == 3
    assert rows[0]["weight_version_segments"] == [{"start": 0, "version": 3}, {"start": 2, "version": 4}]
    assert rows[1]["weight_version"] == 3 and rows[1]["weight_version_segments"] is None


def test_a_row_restarted_at_one_newer_version_looks_like_a_single_version_row() -> None:
    rows = build_table([RolloutRequest(id="a", input_ids=[1])], [[sample(3, version_segments=[(0, 5)])]],
                       CTX).to_pylist()
    assert rows[0]["weight_version"] == 5 and rows[0]["weight_version_segments"] is None


@pytest.mark.parametrize("segments", [[], [(1, 3)], [(0, 3), (0, 4)], [(0, 3), (2, 3)], [(0, 3), (5, 4)],
                                      [(0, -1)]])
def test_segments_that_do_not_cover_the_completion_are_violations(segments: list[tuple[int, int]]) -> None:
    with pytest.raises(ContractViolation, match="weight version segments"):
        build_table([RolloutRequest(id="a", input_ids=[1])], [[sample(5, version_segments=segments)]], CTX)


def test_a_plain_output_of_another_version_is_a_violation() -> None:
    with pytest.raises(ContractViolation, match="engine reports weight version 4, the worker serves 3"):
        build_table([RolloutRequest(id="a", input_ids=[1])], [[sample(2, weight_version=4)]], CTX)


def test_the_whole_sampling_contract_is_echoed_so_logprobs_can_be_recomputed() -> None:
    request = RolloutRequest.model_validate({
        "id": "a", "input_ids": [1],
        "sampling_params": {"temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": -0.25,
                            "repetition_penalty": 1.5, "min_new_tokens": 2, "max_new_tokens": 3},
    })
    row = build_table([request], [[sample(3)]], CTX).to_pylist()[0]
    assert row["temperature"] == pytest.approx(0.7)
    assert (row["frequency_penalty"], row["presence_penalty"], row["repetition_penalty"], row["min_new_tokens"]) == (
        0.5, -0.25, 1.5, 2)
