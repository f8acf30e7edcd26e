"""`pipeline.core.jobs.turn_stream`: a turn's token stream written and read back, and refused when malformed."""

from __future__ import annotations

import fakeredis
import pytest

from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError
from pipeline.core.jobs import turn_stream
from pipeline.core.jobs.turn_stream import TokenDelta


def test_deltas_and_the_end_read_back_in_order_and_expire() -> None:
    conn = fakeredis.FakeRedis()
    with conn.pipeline(transaction=False) as pipe:
        turn_stream.append(pipe, [TokenDelta("t1", 7, 0, 0, [5, 6]), TokenDelta("t1", 7, 1, 0, [9])])
        turn_stream.end(pipe, "t1")
        pipe.execute()
    entries = conn.xrange(keys.turn_stream("t1"))
    read = [turn_stream.parse("t1", fields) for _, fields in entries]
    assert read == [TokenDelta("t1", 7, 0, 0, [5, 6]), TokenDelta("t1", 7, 1, 0, [9]), None]
    assert 0 < conn.ttl(keys.turn_stream("t1")) <= turn_stream.TTL_S


@pytest.mark.parametrize("fields", [
    {b"a": b"1", b"s": b"0", b"o": b"0"},  # no tokens
    {b"a": b"x", b"s": b"0", b"o": b"0", b"t": b""},
    {b"a": b"1", b"s": b"-1", b"o": b"0", b"t": b""},
    {b"a": b"1", b"s": b"0", b"o": b"0", b"t": b"abc"},  # not whole int32s
])
def test_a_malformed_entry_is_refused(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(PipelineError, match="malformed entry"):
        turn_stream.parse("t1", fields)
