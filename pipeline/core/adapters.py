"""A pool's LoRA adapter registry in Redis: each adapter's current version, where it is stored.

`pipeline weights push --adapter` writes the version to the adapter's store first, then
publishes its record here (`publish`), so a record always names a complete stored version.
Version numbers come from one counter per adapter (`next_version`): two pushes racing on one
name get distinct versions, and the record moves only forward (the later version wins, whichever
push finishes first). Submit refuses requests naming an adapter not here (`check_known`); a
worker reads the record when a job names the adapter (`workers.jobs.adapters`).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from pipeline.core.broker import keys
from pipeline.core.errors import AdapterError
from pipeline.core.suggest import did_you_mean, listing
from schemas.adapters import AdapterRecord

# Publish `ARGV[2]` (a record of version `ARGV[3]`) under `ARGV[1]` unless a newer version is there.
_PUBLISH = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  local version = tonumber(cjson.decode(current)['version'])
  if version >= tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def next_version(conn: redis.Redis, pool: str | None, name: str) -> int:
    """The version number the next push of `name` stores (distinct for every push)."""
    return int(conn.hincrby(keys.pool(keys.pool_name(pool)).adapter_versions, name, 1))


def publish(conn: redis.Redis, pool: str | None, record: AdapterRecord) -> bool:
    """Make `record` the adapter's current version; False when a newer version is already current."""
    key = keys.pool(keys.pool_name(pool)).adapters
    return bool(conn.eval(_PUBLISH, 1, key, record.name, record.model_dump_json(), str(record.version)))


def records(conn: redis.Redis, pool: str | None) -> dict[str, AdapterRecord]:
    """Every adapter of the pool, by name."""
    raw = conn.hgetall(keys.pool(keys.pool_name(pool)).adapters)
    return {(k.decode() if isinstance(k, bytes) else k): AdapterRecord.model_validate_json(v) for k, v in raw.items()}


def record(conn: redis.Redis, pool: str | None, name: str) -> AdapterRecord | None:
    raw = conn.hget(keys.pool(keys.pool_name(pool)).adapters, name)
    return None if raw is None else AdapterRecord.model_validate_json(raw)


def remove(conn: redis.Redis, pool: str | None, name: str) -> bool:
    """Forget an adapter (its stored versions stay); requests naming it are refused from now on."""
    return bool(conn.hdel(keys.pool(keys.pool_name(pool)).adapters, name))


def unknown(name: str, known: Iterable[str], pool: str | None) -> str:
    """Why a request naming adapter `name` cannot run in the pool."""
    names = list(known)
    return (f"adapter {name!r} was never pushed to pool {keys.pool_name(pool)!r}{did_you_mean(name, names)} "
            f"(adapters: {listing(names)}); push it with `pipeline weights push --adapter {name} DIR`")


def check_known(conn: redis.Redis, pool: str | None, names: Iterable[str]) -> None:
    """`AdapterError` naming the first of `names` the pool has no adapter of, and those it has."""
    wanted = sorted(set(names))
    if not wanted:
        return
    known = conn.hkeys(keys.pool(keys.pool_name(pool)).adapters)
    have = {k.decode() if isinstance(k, bytes) else k for k in known}
    missing = [n for n in wanted if n not in have]
    if missing:
        raise AdapterError(unknown(missing[0], have, pool))
