"""The control channel, worker side: wake-ups, weight loads with acknowledgements, hand-backs.

`ControlListener` subscribes to the wake-up channel first and only then asks the worker to
read the desired state; it asks again on every message, after every reconnect and every
`poll_s` seconds, so a missed message, a Redis restart or a late start all converge.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job

from pipeline.broker import keys
from pipeline.broker.control_channel import encode_ack
from pipeline.broker.replication import Proof, replicated, write_until_kept
from pipeline.broker.security import check_weight_path
from pipeline.errors import PolicyError
from schemas.control import SwapMode, WeightAck
from workers.engines.base import Engine

log = logging.getLogger(__name__)

POLL_S = 1.0


class ControlListener:
    """A daemon thread calling `on_wake` on subscribe, on every message on `channel` (the pool's
    wake-up channel), on reconnect and periodically."""

    def __init__(self, conn: redis.Redis, channel: str, on_wake: Callable[[], Any], *, poll_s: float = POLL_S) -> None:
        self.conn = conn
        self.channel = channel
        self.on_wake = on_wake
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._pubsub: redis.client.PubSub | None = None
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)

    def start(self) -> None:
        """Subscribe (so no later change is missed), then start the thread, which reads the state first."""
        try:
            self._subscribe()
        except redis.RedisError as exc:
            log.warning("control channel: subscribe failed (%s); will retry", exc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._close()

    def _subscribe(self) -> None:
        self._close()
        pubsub = self.conn.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.channel)
        self._pubsub = pubsub

    def _close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                self._pubsub.close()
            self._pubsub = None

    def _wake(self) -> None:
        try:
            self.on_wake()
        except Exception:  # the listener must outlive any one failure
            log.exception("control channel: handling a wake-up failed")

    def _loop(self) -> None:
        backoff = 0.1
        self._wake()
        while not self._stop.is_set():
            try:
                if self._pubsub is None:
                    self._subscribe()
                    backoff = 0.1
                    self._wake()  # reconnected: whatever was published meanwhile is in the state
                assert self._pubsub is not None
                self._pubsub.get_message(timeout=self.poll_s)
                # A message, or poll_s without one: read the state either way.
                self._wake()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("control channel: %s; reconnecting in %.1f s", exc, backoff)
                self._close()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)


def load_weights(engine: Engine, worker_id: str, path: str, version: int, mode: SwapMode = "drain") -> WeightAck:
    """Ask the engine to load `path` as `version`; never raises: failures become ok=false acks.

    `mode` is how the worker swapped (stated in the ack)."""
    started = time.monotonic()
    error: str | None = None
    try:
        check_weight_path(path)
    except PolicyError as exc:
        log.error("worker %s: refusing to load weights v%d: %s", worker_id, version, exc)
        return WeightAck(worker=worker_id, version=version, ok=False, seconds=0.0, error=f"refused: {exc}",
                         mode=mode)
    try:
        engine.update_weights(path, version)
        if engine.weight_version != version:
            raise RuntimeError(f"engine reports weight version {engine.weight_version} after loading {version}")
    except Exception as exc:  # any load failure is reported; old weights stay
        error = f"{type(exc).__name__}: {exc}"
    return WeightAck(worker=worker_id, version=version, ok=error is None,
                     seconds=float(time.monotonic() - started), error=error, mode=mode)


def write_ack(conn: redis.Redis, ack: WeightAck, pool: str | None = None, *, only_if_missing: bool = False) -> None:
    """Acknowledge a push in `pool`'s acknowledgements of the version, once a replica has it (an ack
    lost in a failover is written again on the new master)."""
    key = keys.pool(pool).weight_acks(ack.version)
    encoded = encode_ack(ack, pool)

    def holds(raw: bytes | None) -> bool:  # any ack of this worker counts when only a missing one was due
        return raw is not None if only_if_missing else raw in (encoded, encoded.encode())

    def write() -> None:
        if only_if_missing:
            conn.hsetnx(key, ack.worker, encoded)
        else:
            conn.hset(key, ack.worker, encoded)

    what = f"acknowledgement of weights v{ack.version} by {ack.worker}"
    write_until_kept(write, lambda _: replicated(conn, what, Proof(("HGET", key, ack.worker), holds)), what)


def hand_back(conn: redis.Redis, job: Job, queue: Queue, *, at_front: bool) -> None:
    """Put a dequeued job back on its queue untouched (it never started)."""
    with conn.pipeline() as pipe:
        pipe.lrem(IntermediateQueue(queue.key, conn).key, 1, job.id)
        if at_front:
            pipe.lpush(queue.key, job.id)
        else:
            pipe.rpush(queue.key, job.id)
        pipe.execute()


def min_weight_version(job: Job) -> int | None:
    """The job payload's `min_weight_version`, if any (None for anything unreadable)."""
    try:
        payload = job.args[0] if job.args else None
    except Exception:  # an unreadable job fails later, in the job itself
        return None
    value = payload.get("min_weight_version") if isinstance(payload, dict) else None
    return value if isinstance(value, int) else None
