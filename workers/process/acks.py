"""A worker's acknowledgement of a push (weights or an adapter version), written where the pusher
waits for it, and kept: it counts once a replica has it, and one lost in a failover is written
again on the new master."""

from __future__ import annotations

import redis

from pipeline.core.broker.control_channel import ack_key, encode_ack
from pipeline.core.broker.replication import Proof, replicated, write_until_kept
from schemas.control import WeightAck


def write_ack(conn: redis.Redis, ack: WeightAck, pool: str | None = None, *, only_if_missing: bool = False) -> None:
    """Acknowledge a push in `pool`'s acknowledgements of the version, once a replica has it (an ack
    lost in a failover is written again on the new master)."""
    key = ack_key(ack, pool)
    encoded = encode_ack(ack, pool)

    def holds(raw: bytes | None) -> bool:  # any ack of this worker counts when only a missing one was due
        return raw is not None if only_if_missing else raw in (encoded, encoded.encode())

    def write() -> None:
        if only_if_missing:
            conn.hsetnx(key, ack.worker, encoded)
        else:
            conn.hset(key, ack.worker, encoded)

    what = f"acknowledgement of {ack.adapter or 'weights'} v{ack.version} by {ack.worker}"
    write_until_kept(write, lambda _: replicated(conn, what, Proof(("HGET", key, ack.worker), holds)), what)
