"""Which Redis to talk to, and how: `--redis URL`, else `$PIPELINE_REDIS_URL`, else the embedded server.

URLs may carry a password (`redis://:secret@host:6379/0`, `unix:///path.sock?password=secret`)
and TLS (`rediss://host:6380/0`). A Sentinel URL,
`redis+sentinel://[:password@]host:port[,host:port…]/MASTER_NAME[/DB]` (`rediss+sentinel://` for
TLS; parsed by `pipeline.core.broker.sentinel_url`), asks the sentinels for the current master on every new
connection, so a client follows a failover: its commands retry (as below) until the promoted
replica answers. Outside the URL:

- `PIPELINE_REDIS_PASSWORD`: the password when the URL has none;
- `PIPELINE_REDIS_TLS_CA`, `PIPELINE_REDIS_TLS_CERT`, `PIPELINE_REDIS_TLS_KEY`: CA bundle and
  client certificate for `rediss://`; `PIPELINE_REDIS_TLS_VERIFY=none` skips verification
  (testing only);
- `PIPELINE_REDIS_SENTINEL_PASSWORD`: the sentinels' own password, for sentinels started with
  `requirepass` (the URL's password is the master's and replicas');
- `PIPELINE_REDIS_RECONNECT_S` (default 60): how long a command keeps retrying, with
  exponential backoff and jitter, while Redis is unavailable, before it raises.

A TCP connection to a Redis whose host stopped answering (cut off, powered off) is dropped after
about `DEAD_PEER_S` (keepalive probes and `TCP_USER_TIMEOUT`), and its command retried as a lost one.

Unavailable (`is_unavailable`) is a lost or refused connection, a timeout, and the replies with which
a Redis refuses a command it has not run: `NOREPLICAS` (a master with fewer replicas than its
`min-replicas-to-write`), `READONLY` (a master demoted to a replica), `MASTERDOWN` (a replica cut off
from its master), `LOADING` (a Redis reading its data at start), `TRYAGAIN`; also when a Lua script's
write got one of them (a refused write aborts the script before it wrote anything).
"""

from __future__ import annotations

import copy
import math
import re
import socket
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.connection import SSLConnection
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection

from pipeline.core import settings
from pipeline.core.broker.redis_server import embedded_server
from pipeline.core.broker.sentinel_url import SENTINEL_SCHEMES, SentinelURL, is_sentinel_url, parse_sentinel_url
from pipeline.core.errors import RedisURLError

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES)
# A Redis refusing a command it has not run, until its replicas, its master or its data are back.
UNAVAILABLE_CODES = frozenset({"NOREPLICAS", "READONLY", "MASTERDOWN", "LOADING", "TRYAGAIN"})
# The same refusal of a write inside a Lua script, wrapped in the script's error (Redis 6: `… -NOREPLICAS …`).
_SCRIPT_REFUSAL = re.compile(r"^Error running script .*: -(" + "|".join(sorted(UNAVAILABLE_CODES)) + r") ")
PROBE_TIMEOUT_S = 1.0
# A Redis host cut off answers nothing, not even a reset: a command in flight to it (or a blocking
# read waiting on it) would wait out the socket timeout (RQ sets 20 s on a worker's; none elsewhere:
# the kernel's retransmissions, a quarter of an hour) before its retry asks the sentinels for the
# promoted master. Keepalive probes after 2 s without traffic, and a connection whose data or probes
# go unacknowledged for DEAD_PEER_S, is dropped (where the platform has these options: Linux).
DEAD_PEER_S = 5
_DEAD_PEER_OPTIONS = {"TCP_KEEPIDLE": 2, "TCP_KEEPINTVL": 1, "TCP_KEEPCNT": DEAD_PEER_S,
                      "TCP_USER_TIMEOUT": DEAD_PEER_S * 1000}


def is_unavailable(error: BaseException) -> bool:
    """Whether `error` means Redis cannot run commands now (down, unreachable, or refusing them until its
    replicas, master or data are back) rather than that this command is wrong: such a command is
    retried (`ReconnectRetry`), and a process reports Redis unavailable instead of failing."""
    if isinstance(error, AuthenticationError | AuthorizationError):
        return False
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return True
    if not isinstance(error, ResponseError):
        return False
    return getattr(error, "status_code", None) in UNAVAILABLE_CODES or bool(_SCRIPT_REFUSAL.match(str(error)))


def resolve_url(url: str | None = None) -> str:
    """The Redis URL to use, starting the embedded server when none is configured."""
    chosen = url or settings.redis_url()
    if chosen:
        return chosen
    return embedded_server().ensure_started()


def redacted(url: str) -> str:
    """The URL with any password replaced by `***`, for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:  # unparseable (e.g. an unclosed IPv6 bracket): keep only what precedes the credentials
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else url
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{user}:***@{host}"
    query = "&".join(
        f"{key}=***" if key == "password" else f"{key}={value}"
        for key, values in parse_qs(parts.query, keep_blank_values=True).items()
        for value in values
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


class ReconnectRetry(Retry):
    """redis-py's `Retry` of the errors `is_unavailable` names (a refused password or permission is
    raised at once), which a process shutting down can stop retrying (`stop_reconnecting`).

    A retried command is one Redis did not run (refused) or may have run (the connection dropped
    before its reply): the same as a lost connection, so writes retried this way must be
    idempotent, as the pipeline's are (the commit log's append replaces a job's earlier commit).

    redis-py deep-copies the retry into every connection of a pool; the copies share one give-up
    time, so stopping the client's retry stops every connection's, pub/sub ones included."""

    ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout, ResponseError)

    def __init__(self, backoff: Any, retries: int) -> None:
        super().__init__(backoff, retries, supported_errors=self.ERRORS)
        self._give_up = _GiveUp()

    def retryable(self, error: Exception) -> bool:
        """Whether `error` is retried now: Redis unavailable (`is_unavailable`), until told to stop. A bare
        socket timeout (redis-py's default retries it) is Python's TimeoutError: not named by
        `is_unavailable`, whose callers see every other kind of error too."""
        return (is_unavailable(error) or isinstance(error, socket.timeout)) and time.monotonic() < self._give_up.at

    def for_asyncio(self) -> Any:
        """The same retry for an asyncio client (`asyncio_twin`): same errors, backoff, retries and
        give-up time."""
        import redis.asyncio.retry

        return redis.asyncio.retry.Retry(copy.deepcopy(self._backoff), self.get_retries(),
                                         supported_errors=self.ERRORS, is_retryable=self.retryable)

    def __deepcopy__(self, memo: dict[int, Any]) -> ReconnectRetry:
        clone = copy.copy(self)
        clone._backoff = copy.deepcopy(self._backoff, memo)
        return clone

    def stop_retrying(self, within_s: float = 0.0) -> None:
        """From `within_s` seconds on, every command that fails to reach Redis raises at once."""
        self._give_up.at = min(self._give_up.at, time.monotonic() + within_s)

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            return self.retryable(error) and (is_retryable(error) if is_retryable is not None else True)

        return super().call_with_retry(do, fail, retryable, with_failure_count)


class _GiveUp:
    """When (time.monotonic()) the retries sharing this stop retrying: never, until told."""

    at: float = math.inf


def stop_reconnecting(conn: redis.Redis, within_s: float = 0.0) -> None:
    """A process shutting down: commands on `conn` (and on every client sharing its connection pool)
    that cannot reach Redis stop retrying `within_s` seconds from now, instead of for
    `PIPELINE_REDIS_RECONNECT_S` each: a worker whose Redis is gone exits when told to."""
    retry = conn.get_retry()
    if isinstance(retry, ReconnectRetry):
        retry.stop_retrying(within_s)


def ping_within(conn: redis.Redis, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """PING `conn`'s Redis once on a connection of its own, each step (connect, reply) bounded by
    `timeout_s`, no retry: a health check's answer in about that time, where `conn`'s commands would
    retry for `PIPELINE_REDIS_RECONNECT_S`. Raises what `conn` would (`is_unavailable` says which mean down)."""
    pool = conn.connection_pool
    connection = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": timeout_s,
                                          "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0),
                                          "retry_on_error": []})
    try:
        connection.send_command("PING")
        connection.read_response()
    finally:
        connection.disconnect()


def retry_policy(reconnect_for_s: float | None = None) -> Retry:
    """Retries with exponential backoff (with jitter) that together last about `reconnect_for_s`."""
    total = settings.redis_reconnect_s() if reconnect_for_s is None else reconnect_for_s
    # The ramp from BACKOFF_BASE_S to the cap takes about 2 * cap; then one retry per cap on average (jitter halves).
    retries = max(1, math.ceil(max(0.0, total - 2 * BACKOFF_CAP_S) / BACKOFF_CAP_S) + 6)
    return ReconnectRetry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)


def client_kwargs(url: str, *, reconnect_for_s: float | None = None) -> dict[str, Any]:
    """Keyword arguments for the data connections to `url`: reconnects, password, TLS.

    For plain URLs these go to `redis.Redis.from_url(url, **kwargs)`; for Sentinel URLs they are
    the master connections' (the URL's own parts are added by `connect_redis`).
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise RedisURLError(
            f"Redis URL {redacted(url)!r} has scheme {scheme!r}; use redis://, rediss:// (TLS), unix://, "
            "redis+sentinel:// or rediss+sentinel://"
        )
    sentinel = parse_sentinel_url(url) if scheme in SENTINEL_SCHEMES else None
    kwargs: dict[str, Any] = {
        "health_check_interval": 30,
        "retry": retry_policy(reconnect_for_s),
    }
    if scheme != "unix":  # TCP only
        kwargs.update(socket_keepalive=True, socket_connect_timeout=10, socket_keepalive_options={
            getattr(socket, name): value for name, value in _DEAD_PEER_OPTIONS.items() if hasattr(socket, name)})
    if sentinel is not None:
        query: dict[str, list[str]] = {}
        has_password = sentinel.password is not None
    else:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        has_password = parts.password is not None or "password" in query
    password = settings.redis_password()
    if not has_password and password:
        kwargs["password"] = password
    if scheme in ("rediss", "rediss+sentinel"):
        kwargs.update(_tls_kwargs(query))
    return kwargs


def _tls_kwargs(query: dict[str, list[str]]) -> dict[str, Any]:
    """Certificates from the environment (unless the URL's query names them) and the verification switch."""
    kwargs: dict[str, Any] = {key: path for key, path in settings.redis_tls_files().items() if key not in query}
    if not settings.redis_tls_verify():
        kwargs["ssl_cert_reqs"] = "none"
        kwargs["ssl_check_hostname"] = False
    return kwargs


class FailoverConnection(SentinelManagedConnection):
    """A master connection that asks the sentinels again on every reconnect.

    redis-py's own reconnects inside a command's retries go straight back to the last address,
    the dead master's, so a command never reaches the promoted replica; this one rediscovers. (A
    demoted master's `READONLY`, in a script's error too, is retried as unavailable: the retry drops
    the connection, and the reconnect asks the sentinels.)
    """

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock or not retry_socket_connect:  # `connect_to` (after discovery) comes back here
            return super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)
        return self.connect()


class FailoverSSLConnection(FailoverConnection, SSLConnection):
    """`FailoverConnection` over TLS."""


class NamedSentinels(Sentinel):
    """Sentinels asked for a master: a name that no sentinel in reach watches is the URL's mistake, said
    at once (`RedisURLError`), not retried as an outage for `PIPELINE_REDIS_RECONNECT_S`."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return super().discover_master(service_name)
        except MasterNotFoundError:
            watched: set[str] | None = None
            for sentinel in self.sentinels:
                try:
                    names = set(sentinel.sentinel_masters())
                except redis.RedisError:
                    continue
                if service_name in names:
                    raise  # watched, but down or not yet elected: an outage, retried
                watched = (watched or set()) | names
            if watched is None:
                raise  # no sentinel answered
            hosts = ",".join(f"{c.connection_pool.connection_kwargs['host']}:"
                             f"{c.connection_pool.connection_kwargs['port']}" for c in self.sentinels)
            raise RedisURLError(
                f"the sentinels at {hosts} watch no master named {service_name!r} (they watch: "
                f"{', '.join(repr(n) for n in sorted(watched)) or 'none'}): put the name from their "
                f"`sentinel monitor NAME ...` in the URL, redis+sentinel://{hosts}/NAME/DB; nothing was done") from None


def sentinel_client(parsed: SentinelURL, data_kwargs: dict[str, Any]) -> redis.Redis:
    """A client of the master the sentinels name now; every new connection asks them again."""
    data = dict(data_kwargs, db=parsed.db)
    if parsed.password is not None:
        data["password"] = parsed.password
    if parsed.username is not None:
        data["username"] = parsed.username
    data["connection_class"] = FailoverSSLConnection if parsed.tls else FailoverConnection
    probe: dict[str, Any] = {key: value for key, value in data.items() if key.startswith(("socket_", "ssl_"))}
    probe.update(ssl=parsed.tls, retry=Retry(NoBackoff(), 0))  # a sentinel that fails passes the turn to the next
    sentinel_password = settings.redis_sentinel_password()
    if sentinel_password:
        probe["password"] = sentinel_password
    manager = NamedSentinels(list(parsed.sentinels), sentinel_kwargs=probe)
    return manager.master_for(parsed.master, **data)


def connect_redis(url: str | None = None, *, reconnect_for_s: float | None = None,
                  max_connections: int | None = None) -> redis.Redis:
    """A client that rides out Redis restarts and Sentinel failovers: commands retry with backoff for a while.

    `max_connections` raises redis-py's limit of 100 connections per client (a server whose
    threads each block on a reply needs more)."""
    chosen = resolve_url(url)
    kwargs = client_kwargs(chosen, reconnect_for_s=reconnect_for_s)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if is_sentinel_url(chosen):
        return sentinel_client(parse_sentinel_url(chosen), kwargs)
    return redis.Redis.from_url(chosen, **kwargs)


def asyncio_twin(conn: redis.Redis, *, max_connections: int | None = None) -> Any:
    """An asyncio client to the same Redis as `conn` (TCP or unix socket, same db and credentials),
    for code that waits on many keys without a thread each; None where `conn` reaches Redis another
    way (Sentinel, TLS): callers then wait in threads."""
    import redis.asyncio  # only servers that wait on the event loop load it

    pool = conn.connection_pool
    kwargs = pool.connection_kwargs
    common = {"db": kwargs.get("db", 0), "username": kwargs.get("username"), "password": kwargs.get("password"),
              "max_connections": max_connections}
    retry = conn.get_retry()
    if isinstance(retry, ReconnectRetry):  # rides out what the sync client rides out (a restart, NOREPLICAS)
        common["retry"] = retry.for_asyncio()
    if pool.connection_class is redis.UnixDomainSocketConnection:
        return redis.asyncio.Redis(unix_socket_path=kwargs["path"], **common)
    if pool.connection_class is redis.Connection:
        return redis.asyncio.Redis(host=kwargs.get("host", "localhost"), port=kwargs.get("port", 6379),
                                   socket_keepalive=kwargs.get("socket_keepalive"),
                                   socket_keepalive_options=kwargs.get("socket_keepalive_options"), **common)
    return None
