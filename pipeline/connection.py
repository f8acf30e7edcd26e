"""Which Redis to talk to, and how: `--redis URL`, else `$PIPELINE_REDIS_URL`, else the embedded server.

URLs may carry a password (`redis://:secret@host:6379/0`, `unix:///path.sock?password=secret`)
and TLS (`rediss://host:6380/0`). Outside the URL:

- `PIPELINE_REDIS_PASSWORD`: the password when the URL has none;
- `PIPELINE_REDIS_TLS_CA`, `PIPELINE_REDIS_TLS_CERT`, `PIPELINE_REDIS_TLS_KEY`: CA bundle and
  client certificate for `rediss://`; `PIPELINE_REDIS_TLS_VERIFY=none` skips verification
  (testing only);
- `PIPELINE_REDIS_RECONNECT_S` (default 60): how long a command keeps retrying, with
  exponential backoff and jitter, while Redis is down or restarting, before it raises.
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, AuthorizationError
from redis.retry import Retry

from pipeline.errors import RedisURLError
from pipeline.redis_server import embedded_server

ENV_URL = "PIPELINE_REDIS_URL"
ENV_PASSWORD = "PIPELINE_REDIS_PASSWORD"
ENV_TLS_CA = "PIPELINE_REDIS_TLS_CA"
ENV_TLS_CERT = "PIPELINE_REDIS_TLS_CERT"
ENV_TLS_KEY = "PIPELINE_REDIS_TLS_KEY"
ENV_TLS_VERIFY = "PIPELINE_REDIS_TLS_VERIFY"
ENV_RECONNECT_S = "PIPELINE_REDIS_RECONNECT_S"

DEFAULT_RECONNECT_S = 60.0
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
SCHEMES = ("redis", "rediss", "unix")


def resolve_url(url: str | None = None) -> str:
    """The Redis URL to use, starting the embedded server when none is configured."""
    chosen = url or os.environ.get(ENV_URL)
    if chosen:
        return chosen
    return embedded_server().ensure_started()


def redacted(url: str) -> str:
    """The URL with any password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
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
    """redis-py's `Retry`, except that a refused password or permission is raised at once."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if isinstance(error, AuthenticationError | AuthorizationError):
                return False
            return is_retryable(error) if is_retryable is not None else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def retry_policy(reconnect_for_s: float | None = None) -> Retry:
    """Retries with exponential backoff (with jitter) that together last about `reconnect_for_s`."""
    total = float(os.environ.get(ENV_RECONNECT_S, DEFAULT_RECONNECT_S)) if reconnect_for_s is None else reconnect_for_s
    # The ramp from BACKOFF_BASE_S to the cap takes about 2 * cap; then one retry per cap on average (jitter halves).
    retries = max(1, math.ceil(max(0.0, total - 2 * BACKOFF_CAP_S) / BACKOFF_CAP_S) + 6)
    return ReconnectRetry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries)


def client_kwargs(url: str, *, reconnect_for_s: float | None = None) -> dict[str, Any]:
    """Keyword arguments for `redis.Redis.from_url(url, **kwargs)`: reconnects, password, TLS."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise RedisURLError(
            f"Redis URL {redacted(url)!r} has scheme {parts.scheme!r}; use redis://, rediss:// (TLS) or unix://"
        )
    kwargs: dict[str, Any] = {
        "health_check_interval": 30,
        "retry": retry_policy(reconnect_for_s),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
    }
    if parts.scheme != "unix":  # TCP only
        kwargs.update(socket_keepalive=True, socket_connect_timeout=10)
    query = parse_qs(parts.query)
    has_password = parts.password is not None or "password" in query
    if not has_password and os.environ.get(ENV_PASSWORD):
        kwargs["password"] = os.environ[ENV_PASSWORD]
    if parts.scheme == "rediss":
        for env, key in ((ENV_TLS_CA, "ssl_ca_certs"), (ENV_TLS_CERT, "ssl_certfile"), (ENV_TLS_KEY, "ssl_keyfile")):
            if os.environ.get(env) and key not in query:
                kwargs[key] = os.environ[env]
        if os.environ.get(ENV_TLS_VERIFY, "").lower() in {"none", "0", "false", "no"}:
            kwargs["ssl_cert_reqs"] = "none"
            kwargs["ssl_check_hostname"] = False
    return kwargs


def connect_redis(url: str | None = None, *, reconnect_for_s: float | None = None) -> redis.Redis:
    """A client that rides out Redis restarts: every command retries with backoff for a while."""
    chosen = resolve_url(url)
    return redis.Redis.from_url(chosen, **client_kwargs(chosen, reconnect_for_s=reconnect_for_s))
