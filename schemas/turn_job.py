"""A job of agent turns queued for a worker (`pipeline.core.jobs.turn_queue`): the one record that
`pipeline serve` writes and the worker reads, as the JSON of one stream entry.

Its payload is `schemas.job_payload.JobPayload` as JSON, with one `TurnTag` per request; the rest
is what running it needs beside: the capabilities it asks for, its timeout, its retries left and
how many runs of it began before (an earlier run may have left a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson


@dataclass(frozen=True)
class TurnJob:
    job_id: str
    payload: dict[str, Any]  # `schemas.job_payload.JobPayload` as JSON, with its turns
    needs: dict[str, Any]
    description: str
    timeout_s: int
    retries_left: int
    enqueued_at: float  # epoch seconds
    attempts: int = 0  # runs begun before (retried): a checkpoint may hold their tokens

    def encode(self) -> bytes:
        # The fields as they are (`asdict` would deep-copy the payload first, on the server's hot path);
        # orjson: a long conversation's prompt (its ids packed, its text) is most of the entry.
        return orjson.dumps(vars(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> TurnJob:
        return cls(**orjson.loads(raw))

    @property
    def turn_ids(self) -> list[str]:
        return [turn["turn_id"] for turn in self.payload.get("turns") or []]

    def retried(self) -> TurnJob:
        """The job queued again after a failed run: one retry spent."""
        return replace(self, attempts=self.attempts + 1, retries_left=self.retries_left - 1)
