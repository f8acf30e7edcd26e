"""The tokens of a streamed agent turn as they are generated, in one place for their writer and reader.

A call to `pipeline serve` with `stream=True` marks its turn (`TurnTag.stream`). The worker
generating it appends to the turn's Redis stream (`keys.turn_stream`), every `EVERY_S` while tokens
come, one entry per sample that grew: the attempt (which execution of
the job generated them), the sample index, the offset of the first token and the token ids; once
the turn's rows are committed, an end entry, in the same round trip as the rows' reply. The server
reads the stream from its start and never consumes it, so a client's retried call reads it again,
and turns the tokens into SSE deltas (`pipeline.serve.live`); the answer's last chunk still comes
from the committed rows, so a streamed answer is the non-streamed one.

A job that runs again (its worker died) appends under a new attempt from offset 0; tokens it
generates differently from what a server already sent end that server's stream with an error
(`pipeline.serve.live.LiveTurn`), never a token twice. Entries are validated when read: the
stream is in Redis, not trusted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError

ATTEMPT, SAMPLE, OFFSET, TOKENS, END = b"a", b"s", b"o", b"t", b"end"
TTL_S = 600  # as long as a turn's reply is kept (`workers.jobs.turn_commits.REPLY_TTL_S`)
EVERY_S = 0.04  # how often a worker publishes the tokens of its streamed turns (25 times a second)
FIRST_EVERY_S = 0.01  # how often it looks while a streamed turn waits for its first tokens


@dataclass(frozen=True)
class TokenDelta:
    """Tokens `[offset, offset + len(token_ids))` of sample `sample` of a turn, from attempt `attempt`."""

    turn_id: str
    attempt: int
    sample: int
    offset: int
    token_ids: Sequence[int]


def append(pipe: Any, deltas: Sequence[TokenDelta]) -> None:
    """Queue `deltas` on a Redis pipeline. A stream's first entries set its expiry (`TTL_S`, again at
    its end); the others leave it (XADD keeps a key's expiry)."""
    streams = set()
    for delta in deltas:
        stream = keys.turn_stream(delta.turn_id)
        if delta.offset == 0:
            streams.add(stream)
        pipe.xadd(stream, {ATTEMPT: delta.attempt, SAMPLE: delta.sample, OFFSET: delta.offset,
                           TOKENS: np.asarray(delta.token_ids, dtype="<i4").tobytes()})
    for stream in streams:
        pipe.expire(stream, TTL_S)


def end(pipe: Any, turn_id: str) -> None:
    """Queue the end entry of a turn whose rows are committed."""
    stream = keys.turn_stream(turn_id)
    pipe.xadd(stream, {END: 1})
    pipe.expire(stream, TTL_S)


def parse(turn_id: str, fields: Mapping[bytes, bytes]) -> TokenDelta | None:
    """An entry read back: its delta, or None for the end entry. `PipelineError` for anything else."""
    if END in fields:
        return None
    try:
        attempt, sample, offset = int(fields[ATTEMPT]), int(fields[SAMPLE]), int(fields[OFFSET])
        raw = fields[TOKENS]
    except (KeyError, ValueError) as exc:
        raise PipelineError(f"turn {turn_id}: a malformed entry in its token stream ({exc!r})") from None
    if attempt < 0 or sample < 0 or offset < 0 or len(raw) % 4:
        raise PipelineError(f"turn {turn_id}: a malformed entry in its token stream (attempt {attempt}, sample "
                            f"{sample}, offset {offset}, {len(raw)} bytes of tokens)")
    return TokenDelta(turn_id, attempt, sample, offset, np.frombuffer(raw, dtype="<i4").tolist())
