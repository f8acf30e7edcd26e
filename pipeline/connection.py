"""Which Redis to talk to: `--redis URL`, else `$PIPELINE_REDIS_URL`, else the embedded server."""

from __future__ import annotations

import os

import redis

from pipeline.redis_server import embedded_server

ENV_URL = "PIPELINE_REDIS_URL"


def resolve_url(url: str | None = None) -> str:
    """The Redis URL to use, starting the embedded server when none is configured."""
    chosen = url or os.environ.get(ENV_URL)
    if chosen:
        return chosen
    return embedded_server().ensure_started()


def connect_redis(url: str | None = None) -> redis.Redis:
    """A client with reconnect-friendly settings (health checks, retries on timeouts)."""
    return redis.Redis.from_url(
        resolve_url(url),
        health_check_interval=30,
        retry_on_timeout=True,
    )
