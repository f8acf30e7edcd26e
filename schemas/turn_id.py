"""A turn's id: `{session}-{turn:05d}-{nonce}`, written and parsed here alone.

`pipeline serve` names each call of a session by it (the turn log, the inbox, the shard's rows
are found under it); the nonce tells apart two calls that claimed the same turn number (a call
retried after its server died), so a late answer is never taken for the new one's.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

_FORM = re.compile(r"^(?P<session>.+)-(?P<turn>\d{5,})-(?P<nonce>[0-9a-f]{6})$")


@dataclass(frozen=True)
class TurnId:
    session_id: str
    turn: int
    nonce: str

    @classmethod
    def new(cls, session_id: str, turn: int) -> TurnId:
        return cls(session_id, turn, uuid.uuid4().hex[:6])

    @classmethod
    def parse(cls, text: str) -> TurnId:
        match = _FORM.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a turn id ({{session}}-{{turn:05d}}-{{6 hex digits}})")
        return cls(match["session"], int(match["turn"]), match["nonce"])

    def __str__(self) -> str:
        return f"{self.session_id}-{self.turn:05d}-{self.nonce}"
