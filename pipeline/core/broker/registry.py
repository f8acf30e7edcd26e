"""The live-worker registry in Redis, one per pool: entries with a TTL that each worker's heartbeat
refreshes, and the pool's set of worker ids (pruned of expired entries on read); and what exists
to be named: the pools and the runs submitted to them."""

from __future__ import annotations

import time

import redis
from pydantic import ValidationError

from pipeline.core.broker import keys
from schemas.worker_info import WorkerInfo

DEFAULT_TTL_S = 30


def publish(conn: redis.Redis, info: WorkerInfo, ttl_s: int = DEFAULT_TTL_S, *, membership: bool = True) -> None:
    """Write (or refresh) a worker's entry in its pool; it disappears `ttl_s` after the last refresh.
    `membership=False` writes the entry alone (one command), for a change between heartbeats of a
    worker whose last heartbeat put it in its pool's set."""
    info.heartbeat_at = time.time()
    pool = keys.pool(info.pool)
    if not membership:
        conn.set(pool.worker(info.worker_id), info.model_dump_json(), ex=ttl_s)
        return
    with conn.pipeline(transaction=False) as pipe:  # one round trip; each write stands alone
        pipe.set(pool.worker(info.worker_id), info.model_dump_json(), ex=ttl_s)
        pipe.sadd(pool.workers, info.worker_id)
        pipe.sadd(keys.POOLS, pool.name)
        pipe.execute()


def remove(conn: redis.Redis, worker_id: str, pool: str | None = None) -> None:
    where = keys.pool(pool)
    with conn.pipeline() as pipe:
        pipe.delete(where.worker(worker_id))
        pipe.srem(where.workers, worker_id)
        pipe.execute()


def live_workers(conn: redis.Redis, pool: str | None = None) -> list[WorkerInfo]:
    """Entries of the pool's workers whose heartbeat has not expired; expired ids are pruned."""
    where = keys.pool(pool)
    ids = sorted(m.decode() for m in conn.smembers(where.workers))
    if not ids:
        return []
    raw = conn.mget([where.worker(i) for i in ids])
    alive: list[WorkerInfo] = []
    for worker_id, value in zip(ids, raw, strict=True):
        if value is None:
            conn.srem(where.workers, worker_id)
            continue
        try:
            alive.append(WorkerInfo.model_validate_json(value))
        except ValidationError:
            continue  # an entry written by another release: not ours to judge
    return alive


def pools(conn: redis.Redis) -> list[str]:
    """Every pool named so far (by a submit, a worker or a control change), `default` first."""
    named = {m.decode() for m in conn.smembers(keys.POOLS)} - {keys.DEFAULT_POOL}
    return [keys.DEFAULT_POOL, *sorted(named)]


def unknown_pool(conn: redis.Redis, pool: str) -> str | None:
    """Why `pool` may be a typo, with the closest known name, or None when a submit, a worker or a
    control change has named it on this Redis (`default` always is)."""
    from pipeline.core.suggest import did_you_mean, listing

    known = pools(conn)
    if pool in known:
        return None
    return (f"pool {pool!r} has never been named on this Redis (by a submit, a worker or a weight push)"
            f"{did_you_mean(pool, known)} (pools: {listing(known)})")


def runs(conn: redis.Redis) -> list[str]:
    """Every run submitted to any pool, sorted (for "did you mean" when a run is not found)."""
    names: set[str] = set()
    for pool in pools(conn):
        names.update(m.decode(errors="replace") for m in conn.smembers(keys.pool(pool).runs))
    return sorted(names)
