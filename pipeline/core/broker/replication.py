"""Acknowledged means replicated: after a write the pipeline reports as done, wait for replicas.

Redis replicates asynchronously, so a master that dies (or that the sentinels demote while it
still answers) can take its last writes with it. Where the pipeline tells someone "done" (a
submit's enqueue, a commit-log append, a control state change, a weight acknowledgement) it
calls `replicated(conn, what, proof)`, which waits with `WAIT` until enough replicas have
everything written so far, and proves, in the same round trip, that the write is still on the
server it waits on:

- `PIPELINE_REDIS_WAIT_REPLICAS`: `auto` (default) waits for every replica the master has online
  (in sync; counted at most every `CHECK_EVERY_S` per client, and again after a slice that timed
  out), so that whichever the sentinels promote has the write, and not at all when it has none;
  a number waits for that many; `0` turns the wait off.
- `PIPELINE_REDIS_WAIT_TIMEOUT_MS` (default 10000): how long to wait in all, in slices of at most
  `SLICE_MS`. A slice that falls short asks the sentinels which master they name *now*, so a
  failover during the wait is noticed, also one that demoted a master still answering (it takes
  writes until the sentinels turn it into a replica, and they are lost then): when the write is
  not on the new master, `WriteLostError` is raised and the caller writes again
  (`write_until_kept`: a commit, a control change, an ack) or says so (a submit,
  `pipeline.submit.enqueue`). Under Sentinel a replica that leaves while a write waits does not
  lower the count waited for (a replica being promoted leaves its master first), and a master
  with no replica to wait for is checked against the sentinels' answer before a write counts.
  Nor does a count re-read lower while a replica that left now answers as a master (or follows
  another one): the sentinels are promoting it, and for a second or so they still name the old
  master, whose remaining replicas would confirm writes the promotion drops (`_departed_promoted`).
- A wait that runs out while the write is still on a live master is reported, not raised: a
  warning names the write and how many replicas confirmed it; only that master's death in that
  window could still lose it (then a job re-runs; `workers.jobs.reconcile` finds what it orphaned).

`WAIT` counts the writes of the connection it runs on, and the write being acknowledged may have
gone out on another connection of the pool, or to a master that has died since; so each slice
reads the proof (`Proof`: one read command and a test of its reply), makes one tiny write of its
own (`INCR` of a probe key) and waits for that, all in one pipeline on one connection (replication
is ordered: a replica that has the probe has everything the master held before it, the proof's
write included). A pipeline that fails over is re-run whole on the new master by the client's
retries, so the proof is always read where the wait happens.
"""

from __future__ import annotations

import logging
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from pipeline.core import settings
from pipeline.core.broker import keys
from pipeline.core.errors import WriteLostError

SLICE_MS = 500
LOST_WRITE_ATTEMPTS = 3  # writes lost in failovers in a row before `WriteLostError` reaches the caller
CHECK_EVERY_S = 5.0
PROMOTION_PROBE_TIMEOUT_S = 0.5  # asking a replica that left its master whether it is being promoted

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class _Seen:
    """A client's last count of its master's replicas: when, which master, which replicas."""

    at: float
    master: tuple[str, int] | None
    replicas: frozenset[tuple[str, int]]


_replicas_seen: weakref.WeakKeyDictionary[Any, _Seen] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Proof:
    """How to tell that a write is on a server: one read command (`args`, e.g. `("EXISTS", key)`)
    and a test of its reply (`holds`)."""

    args: tuple[Any, ...]
    holds: Callable[[Any], bool] = bool


def wanted_replicas(conn: redis.Redis, *, fresh: bool = False) -> int:
    """How many replicas a write must reach before it counts as acknowledged (0: no wait)."""
    setting = settings.redis_wait_replicas()
    if setting is not None:
        return setting
    pool = conn.connection_pool
    now = time.monotonic()
    seen = _replicas_seen.get(pool)
    master = _master_address(conn)  # under Sentinel a count is the master's it was read from, not the next one's
    if fresh or seen is None or now - seen.at > CHECK_EVERY_S or seen.master != master:
        try:
            info = conn.info("replication")
        except redis.ResponseError:  # a server without INFO (fakeredis): no replicas to wait for
            info = {}
        # Replicas in sync (a replica still loading a full copy acknowledges nothing until it is done).
        online = frozenset((str(value.get("ip")), int(value.get("port", 0))) for key, value in info.items()
                           if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")
        if (master is not None and seen is not None and seen.master == master and len(online) < len(seen.replicas)
                and _departed_promoted(pool, master, seen.replicas - online)):
            online = seen.replicas  # this master is being demoted: wait for as many as before (see above)
        seen = _Seen(now, master, online)
        _replicas_seen[pool] = seen
    return len(seen.replicas)


def _departed_promoted(pool: SentinelConnectionPool, master: tuple[str, int],
                       departed: frozenset[tuple[str, int]]) -> bool:
    """Whether a replica that left `master` answers as a master, or as another master's replica: the
    sentinels are failing over from `master` (they promote a replica first, then name it), so what
    `master` takes now is lost. One that does not answer is taken for gone (a dead replica)."""
    kwargs = pool.connection_kwargs
    auth = {key: kwargs[key] for key in ("username", "password") if kwargs.get(key) is not None}
    tls = {key: value for key, value in kwargs.items() if key.startswith("ssl_")}
    for host, port in departed:
        replica = redis.Redis(host=host, port=port, socket_timeout=PROMOTION_PROBE_TIMEOUT_S,
                              socket_connect_timeout=PROMOTION_PROBE_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                              ssl=issubclass(pool.connection_class, redis.SSLConnection), **auth, **tls)
        try:
            role = replica.execute_command("ROLE")
        except (redis.RedisError, OSError):
            continue
        finally:
            replica.close()
        kind = _text(role[0])
        if kind == "master":
            return True
        if kind == "slave" and not _same_address((_text(role[1]), int(role[2])), master):
            return True
    return False


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two addresses name one server (a host name against an IP resolved: replicas and
    sentinels may spell the master differently)."""
    if a == b:
        return True
    if a[1] != b[1]:
        return False
    try:
        return socket.gethostbyname(a[0]) == socket.gethostbyname(b[0])
    except OSError:
        return False


def _master_address(conn: redis.Redis) -> tuple[str, int] | None:
    """The address of the master a Sentinel client's connections go to (None for any other client)."""
    pool = conn.connection_pool
    return pool.master_address if isinstance(pool, SentinelConnectionPool) else None


def replicated(conn: redis.Redis, what: str, proof: Proof) -> int | None:
    """Wait until the configured number of replicas has the write `proof` checks; the number that
    confirmed (None when no wait is configured). `WriteLostError` when the master the sentinels
    name now does not have the write (it was lost with the master that took it). `what` names
    the write in errors and in the warning on a timeout."""
    want = wanted_replicas(conn)
    sentinels = conn.connection_pool if isinstance(conn.connection_pool, SentinelConnectionPool) else None
    if want == 0:
        if sentinels is not None and _master_moved(sentinels) and not proof.holds(conn.execute_command(*proof.args)):
            raise WriteLostError(what)
        return None
    started_with, master = want, _master_address(conn)
    limit = settings.redis_wait_timeout_ms()
    deadline = time.monotonic() + limit / 1000
    while True:
        slice_ms = max(1, min(SLICE_MS, int((deadline - time.monotonic()) * 1000)))
        with conn.pipeline(transaction=False) as pipe:  # one connection: proof, probe write, WAIT for it
            pipe.execute_command(*proof.args)
            pipe.incr(keys.REPLICATION_PROBE)
            pipe.execute_command("WAIT", want, slice_ms)
            reply, _, confirmed = pipe.execute()
        if not proof.holds(reply):
            raise WriteLostError(what)
        if int(confirmed) >= want:
            return int(confirmed)
        if time.monotonic() >= deadline:
            break
        if sentinels is not None and _master_moved(sentinels):
            continue  # the next slice runs on the master named now: its proof says whether the write is there
        fresh = wanted_replicas(conn, fresh=True)
        if sentinels is not None and _master_address(conn) == master:
            # Under Sentinel a replica leaving a master is what a failover looks like: the replica
            # being promoted stops replicating first, and the master answers (and takes writes the
            # promotion loses) until the sentinels demote it. So wait for as many as before, asking
            # the sentinels each slice, until the timeout.
            want = max(fresh, started_with)
        else:
            # The replica may have gone (auto: nothing to wait for); or the wait moved to the master
            # the sentinels named after a failover, where the proof held: its own replicas count.
            started_with, master = fresh, _master_address(conn)
            want = fresh
            if want == 0:
                return None
    log.warning("%s: written on the Redis master but %d of %d replica(s) confirmed it within %d ms "
                "(%s); a failover now could lose it", what, int(confirmed), want, limit,
                settings.REDIS_WAIT_TIMEOUT_MS.name)
    return int(confirmed)


def _master_moved(pool: SentinelConnectionPool) -> bool:
    """Whether the sentinels name a master other than the one `pool`'s connections went to (a
    failover, whose old master may still answer: what it takes now is lost when it is demoted).
    redis-py then drops the pool's idle connections, so the next command asks the new master."""
    before = pool.master_address
    try:
        return pool.get_master_address() != before
    except redis.RedisError:  # no sentinel names a master now (mid-failover): the next slice asks again
        return False


def write_until_kept(write: Callable[[], T], confirm: Callable[[T], object], what: str) -> T:
    """`write()`, then `confirm(result)` (a `replicated` wait); when a failover lost the write
    (`WriteLostError`), write again on the new master, `LOST_WRITE_ATTEMPTS` times in all. The
    write must be safe to repeat. Returns what the kept write returned."""
    attempt = 1
    while True:
        result = write()
        try:
            confirm(result)
            return result
        except WriteLostError:
            if attempt >= LOST_WRITE_ATTEMPTS:
                raise
            log.warning("%s was lost in a Redis failover; writing it again (%d/%d)", what, attempt,
                        LOST_WRITE_ATTEMPTS)
            attempt += 1
