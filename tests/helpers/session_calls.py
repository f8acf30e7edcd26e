"""What tests read of a session's calls in Redis (`pipeline.serve.sessions`): the calls in flight."""

from __future__ import annotations

import redis

from pipeline.core.broker import keys
from pipeline.serve.sessions import Pending


def turn_ids_in_flight(conn: redis.Redis, session_id: str) -> list[str]:
    """The turn ids of the session's calls in flight (claimed, not yet recorded), in call order."""
    pending = {int(field[2:]): Pending.from_json(raw)
               for field, raw in conn.hgetall(keys.session_calls(session_id)).items() if field.startswith(b"p:")}
    return [pending[turn].turn_id(session_id, turn) for turn in sorted(pending)]
