"""A turn's answer on its way to the server that waits for it: one entry of the server's inbox
(`keys.serve_inbox`), the turn id, a newline, then the rows as Arrow IPC or an encoded
`schemas.turn_failure.TurnFailure`. Workers push the answers of a job's turns with one RPUSH (and
one EXPIRE, so the inbox of a server that died goes away); the server takes them in batches
(`pipeline.serve.inbox`)."""

from __future__ import annotations

from collections.abc import Iterable

import redis

from pipeline.core.broker import keys

INBOX_TTL_S = 600  # answers nobody took (their server died) expire


def entry(turn_id: str, payload: bytes) -> bytes:
    """An inbox entry: the turn id, a newline, the answer."""
    return turn_id.encode() + b"\n" + payload


def parse(raw: bytes) -> tuple[str, bytes]:
    """(turn id, answer) of an inbox entry; ValueError if it is not one."""
    turn_id, sep, payload = raw.partition(b"\n")
    if not sep or not turn_id:
        raise ValueError("an inbox entry is a turn id, a newline and the answer")
    return turn_id.decode(), payload


def push(pipe: redis.client.Pipeline, answers: Iterable[tuple[str, str, bytes]]) -> None:
    """Queue (server id, turn id, answer) entries on `pipe`: one RPUSH and one EXPIRE per server."""
    by_server: dict[str, list[bytes]] = {}
    for server_id, turn_id, payload in answers:
        by_server.setdefault(server_id, []).append(entry(turn_id, payload))
    for server_id, entries in by_server.items():
        pipe.rpush(keys.serve_inbox(server_id), *entries)
        pipe.expire(keys.serve_inbox(server_id), INBOX_TTL_S)
