"""A pool's LoRA adapter registry in Redis: each adapter's current version, where it is stored.

`pipeline weights push --adapter` writes the version to the adapter's store first, then
publishes its record here (`publish`), so a record always names a complete stored version.
Version numbers come from one counter per adapter (`next_version`): two pushes racing on one
name get distinct versions, and the record moves only forward (the later version wins, whichever
push finishes first). Submit refuses requests naming an adapter not here (`unknown` says why); a
worker reads the record when a job names the adapter (`workers.jobs.adapters`). Each adapter's
versions are stored under the pool's weight store (`adapter_url`), each with its config.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import redis

from pipeline.core.broker import keys
from pipeline.core.errors import AdapterError
from pipeline.core.suggest import did_you_mean, listing
from pipeline.core.weights.store import WeightStore, default_url, version_dir
from schemas.adapters import AdapterRecord

# An adapter version's `adapter_config.json`, stored beside its tensors (what peft wrote).
CONFIG_FILE = "adapter_config.json"
# How many versions of an adapter a push keeps in its store (`pipeline.weights.adapter_push`); TRL's
# async GRPO keeps max_staleness + 1 adapter versions registered (trl#7017).
DEFAULT_KEEP_VERSIONS = 8

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


# Put back `ARGV[3]` (a record, or '' for none) under `ARGV[1]` if version `ARGV[2]` is still current.
_RESTORE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or tonumber(cjson.decode(current)['version']) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""


def adapter_url(store: str | None, pool: str | None, name: str) -> str:
    """Where the versions of adapter `name` are stored."""
    return f"{store or default_url(keys.pool_name(pool))}/adapters/{name}"


def stored_record(url: str, name: str, version: int) -> AdapterRecord:
    """The record of any stored version of an adapter (its config is stored beside its tensors): what
    `pipeline verify` loads an old version by."""
    weights = WeightStore(url)
    manifest = weights.manifest(version)
    try:
        config = json.loads(weights.fs.cat_file(f"{weights.root}/{version_dir(version)}/{CONFIG_FILE}"))
    except FileNotFoundError:
        raise AdapterError(f"{url}: version {version} has no {CONFIG_FILE}; it is not an adapter's store") from None
    return AdapterRecord(name=name, version=version, url=url, rank=int(config["r"]),
                         target_modules=target_modules(config), config=config, stored_bytes=manifest.stored_bytes)


def target_modules(config: dict[str, Any]) -> list[str]:
    """A peft config's `target_modules` as a sorted list (peft allows one name, or a regex, as a string)."""
    targets = config.get("target_modules") or []
    return [targets] if isinstance(targets, str) else sorted(targets)


def next_version(conn: redis.Redis, pool: str | None, name: str) -> int:
    """The version number the next push of `name` stores (distinct for every push)."""
    return int(conn.hincrby(keys.pool(keys.pool_name(pool)).adapter_versions, name, 1))


def publish(conn: redis.Redis, pool: str | None, record: AdapterRecord) -> bool:
    """Make `record` the adapter's current version; False when a newer version is already current."""
    key = keys.pool(keys.pool_name(pool)).adapters
    return bool(conn.eval(_PUBLISH, 1, key, record.name, record.model_dump_json(), str(record.version)))


def restore(conn: redis.Redis, pool: str | None, name: str, pushed: int, previous: AdapterRecord | None) -> bool:
    """Undo the publication of version `pushed` of `name` (no worker could take it): `previous` is
    current again (or the adapter unknown, with none), unless a newer version was published since."""
    key = keys.pool(keys.pool_name(pool)).adapters
    return bool(conn.eval(_RESTORE, 1, key, name, str(pushed), "" if previous is None else previous.model_dump_json()))


def records(conn: redis.Redis, pool: str | None) -> dict[str, AdapterRecord]:
    """Every adapter of the pool, by name."""
    raw = conn.hgetall(keys.pool(keys.pool_name(pool)).adapters)
    return {(k.decode() if isinstance(k, bytes) else k): AdapterRecord.model_validate_json(v) for k, v in raw.items()}


def remove(conn: redis.Redis, pool: str | None, name: str) -> bool:
    """Forget an adapter (its stored versions stay); requests naming it are refused from now on."""
    return bool(conn.hdel(keys.pool(keys.pool_name(pool)).adapters, name))


def check_known(conn: redis.Redis, pool: str | None, name: str) -> None:
    """`AdapterError` (saying why, and the adapters there are) unless the pool has adapter `name`."""
    found = records(conn, pool)
    if name not in found:
        raise AdapterError(unknown(name, found, pool))


def unknown(name: str, known: Iterable[str], pool: str | None) -> str:
    """Why a request naming adapter `name` cannot run in the pool."""
    names = list(known)
    return (f"adapter {name!r} was never pushed to pool {keys.pool_name(pool)!r}{did_you_mean(name, names)} "
            f"(adapters: {listing(names)}); push it with `pipeline weights push --adapter {name} DIR`")
