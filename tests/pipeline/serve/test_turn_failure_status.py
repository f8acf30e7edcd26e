"""A turn's failure, as its worker coded it, becomes the HTTP status `pipeline serve` answers."""

from __future__ import annotations

import pytest

from pipeline.serve.api_error import APIError
from pipeline.serve.turn_wait import _rows
from schemas.turn_failure import TurnFailure


@pytest.mark.parametrize(("error_class", "status"), [
    ("UnsupportedRequestError", 400),  # no worker can serve the call: the caller's to change
    ("NotAllowedJobError", 400),
    ("WorkerError", 500),
    ("RuntimeError", 500),
])
def test_an_answer_that_is_a_failure_is_its_codes_status(error_class: str, status: int) -> None:
    with pytest.raises(APIError) as raised:
        _rows(TurnFailure.of(error_class, "why").encode())
    assert (raised.value.status, raised.value.code) == (status, "turn_failed")
    assert f"{error_class}: why" in str(raised.value)
