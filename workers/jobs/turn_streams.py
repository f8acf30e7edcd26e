"""A job's streamed turns: which tokens to publish next (`pipeline.core.jobs.turn_stream`).

A job of turns whose calls asked for `stream=True` gets a `TurnStreams` at admission. Every
`turn_stream.EVERY_S` the feeder's completion thread takes each such job's samples so far
(`Progress.so_far` over the engine's `progress()` snapshot) and asks for the tokens not yet
published, then sends those of all its jobs in one round trip. A job continued after a partial
swap keeps its offsets (a continuation extends its sample's tokens verbatim); a job run again
by another worker (this one died) starts a new attempt from offset 0.

Samples with penalties are not streamed: a partial swap restarts them from their prompt
(`workers.rows.continuation`), which would take back tokens a client already has; their turn's
answer comes whole at its end, as it does on an engine that cannot report its progress.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pipeline.core.jobs.turn_stream import TokenDelta
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from workers.rows.continuation import Slot, has_penalties


class TurnStreams:
    """The streamed turns of one job (one request each) and how much of each sample was published."""

    def __init__(self, turn_ids: Mapping[int, str], attempt: int) -> None:
        self.attempt = attempt
        self._turn_ids = dict(turn_ids)  # request index -> turn id, for the requests streamed
        self._published: dict[Slot, int] = {}

    @classmethod
    def of(cls, requests: Sequence[RolloutRequest], turns: Sequence[TurnTag] | None,
           attempt: int) -> TurnStreams | None:
        """The job's streams, or None when none of its turns streams."""
        turn_ids = {r: turn.turn_id for r, (request, turn) in enumerate(zip(requests, turns or (), strict=False))
                    if turn.stream and not has_penalties(request.sampling_params)}
        return cls(turn_ids, attempt) if turn_ids else None

    @property
    def started(self) -> bool:
        """Some tokens of every streamed turn were published (the first ones go out sooner)."""
        return {self._turn_ids[r] for r, _ in self._published} == set(self._turn_ids.values())

    def deltas(self, so_far: Mapping[Slot, np.ndarray]) -> list[TokenDelta]:
        """The tokens generated since the last call, per sample; noted as published."""
        found = []
        for (r, i), tokens in so_far.items():
            turn_id = self._turn_ids.get(r)
            published = self._published.get((r, i), 0)
            if turn_id is None or len(tokens) <= published:
                continue
            found.append(TokenDelta(turn_id, self.attempt, i, published, tokens[published:].tolist()))
            self._published[(r, i)] = len(tokens)
        return found

    def unpublish(self, deltas: Sequence[TokenDelta]) -> None:
        """`deltas` (from `deltas`) did not reach Redis: the next call sends them again."""
        for delta in deltas:
            for (r, i), published in list(self._published.items()):
                if self._turn_ids.get(r) == delta.turn_id and i == delta.sample:
                    self._published[(r, i)] = min(published, delta.offset)
