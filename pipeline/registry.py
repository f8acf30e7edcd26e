"""The live-worker registry in Redis: entries with a TTL that each worker's heartbeat refreshes."""

from __future__ import annotations

import time

import redis
from pydantic import ValidationError

from pipeline import keys
from schemas.worker_info import WorkerInfo

DEFAULT_TTL_S = 30


def publish(conn: redis.Redis, info: WorkerInfo, ttl_s: int = DEFAULT_TTL_S) -> None:
    """Write (or refresh) a worker's entry; it disappears `ttl_s` after the last refresh."""
    info.heartbeat_at = time.time()
    with conn.pipeline() as pipe:
        pipe.set(keys.worker(info.worker_id), info.model_dump_json(), ex=ttl_s)
        pipe.sadd(keys.WORKERS, info.worker_id)
        pipe.execute()


def remove(conn: redis.Redis, worker_id: str) -> None:
    with conn.pipeline() as pipe:
        pipe.delete(keys.worker(worker_id))
        pipe.srem(keys.WORKERS, worker_id)
        pipe.execute()


def live_workers(conn: redis.Redis) -> list[WorkerInfo]:
    """Entries of workers whose heartbeat has not expired; expired ids are pruned."""
    ids = sorted(m.decode() for m in conn.smembers(keys.WORKERS))
    if not ids:
        return []
    raw = conn.mget([keys.worker(i) for i in ids])
    alive: list[WorkerInfo] = []
    for worker_id, value in zip(ids, raw, strict=True):
        if value is None:
            conn.srem(keys.WORKERS, worker_id)
            continue
        try:
            alive.append(WorkerInfo.model_validate_json(value))
        except ValidationError:
            continue  # an entry written by another release: not ours to judge
    return alive
