"""A submit naming one request id twice is refused whole, naming the id, wherever the two fall."""

from __future__ import annotations

import fakeredis
import pytest

import pipeline
from pipeline.core.errors import PipelineError


@pytest.mark.parametrize("batch_size", [1, 2, 10])  # the twice-named id in another job, or in the same one
def test_an_id_named_twice_is_refused_naming_it_and_nothing_is_enqueued(batch_size: int) -> None:
    conn = fakeredis.FakeRedis()
    requests = [{"id": f"r{i % 3}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}} for i in range(5)]
    with pytest.raises(PipelineError, match="request id 'r0' appears twice"):
        pipeline.Client(conn).submit(requests, run="dup", batch_size=batch_size, output="file:///tmp/unused")
    assert not [k for k in conn.keys("rq:job:*")]
