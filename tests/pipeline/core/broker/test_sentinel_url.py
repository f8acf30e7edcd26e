"""Sentinel URLs: what the parser accepts, the one-line errors for what it refuses, the client it builds."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from pipeline.core.broker.connection import (
    FailoverConnection,
    FailoverSSLConnection,
    client_kwargs,
    connect_redis,
    redacted,
)
from pipeline.core.broker.sentinel_url import SentinelURL, is_sentinel_url, parse_sentinel_url
from pipeline.core.errors import PipelineError, RedisURLError


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+sentinel://h1:26379/mymaster", SentinelURL((("h1", 26379),), "mymaster", 0, False, None, None)),
        ("redis+sentinel://h1:1,h2:2,10.0.0.3:3/m/5",
         SentinelURL((("h1", 1), ("h2", 2), ("10.0.0.3", 3)), "m", 5, False, None, None)),
        ("redis+sentinel://:pw@h1:1,h2:2/m", SentinelURL((("h1", 1), ("h2", 2)), "m", 0, False, None, "pw")),
        ("redis+sentinel://alice:pw@h:1/m", SentinelURL((("h", 1),), "m", 0, False, "alice", "pw")),
        ("redis+sentinel://pw@h:1/m", SentinelURL((("h", 1),), "m", 0, False, None, "pw")),
        ("rediss+sentinel://:p%40ss%3Aw%2Cd@h/m.a-b_c/12",
         SentinelURL((("h", 26379),), "m.a-b_c", 12, True, None, "p@ss:w,d")),
        ("REDIS+SENTINEL://[::1]:5000,[fe80::2]/m", SentinelURL((("::1", 5000), ("fe80::2", 26379)), "m", 0, False,
                                                                None, None)),
        ("redis+sentinel://h:1/m/", SentinelURL((("h", 1),), "m", 0, False, None, None)),
    ],
)
def test_well_formed_urls_parse(url: str, expected: SentinelURL) -> None:
    assert is_sentinel_url(url)
    assert parse_sentinel_url(url) == expected


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("redis+sentinel://h:1", "no master name"),
        ("redis+sentinel://h:1/", "no master name"),
        ("redis+sentinel:///m", "no sentinel host"),
        ("redis+sentinel://:pw@/m", "no sentinel host"),
        ("redis+sentinel://h1:1,,h2:2/m", "no sentinel host"),
        ("redis+sentinel://h1:1,/m", "no sentinel host"),
        ("redis+sentinel://h:/m", "empty port"),
        ("redis+sentinel://h:abc/m", "port 'abc' of 'h' is not a number"),
        ("redis+sentinel://h:0/m", "port '0' of 'h'"),
        ("redis+sentinel://h:65536/m", "port '65536'"),
        ("redis+sentinel://h:-1/m", "port '-1'"),
        ("redis+sentinel://:5000/m", "no host name before the port"),
        ("redis+sentinel://::1:5000/m", "IPv6 addresses in brackets"),
        ("redis+sentinel://[::1:5000/m", "does not close"),
        ("redis+sentinel://[::1]x5000/m", "not ':port'"),
        ("redis+sentinel://[]:5000/m", "does not close"),
        ("redis+sentinel://h%20x:1/m", "not a host name"),
        ("redis+sentinel://h:1/m/x", "database 'x' is not a non-negative integer"),
        ("redis+sentinel://h:1/m/-1", "database '-1'"),
        ("redis+sentinel://h:1/m/0/extra", "too many path segments"),
        ("redis+sentinel://h:1/m//", "too many path segments"),
        ("redis+sentinel://h:1/my master/0", "master name 'my master'"),
        ("redis+sentinel://h:1/m?password=x", "query parameters"),
        ("redis+sentinel://h:1/m#frag", "query parameters"),
        ("sentinel://h:1/m", "not a Sentinel URL"),
    ],
)
def test_malformed_urls_are_refused_in_one_line(url: str, complaint: str) -> None:
    with pytest.raises(RedisURLError, match=complaint) as caught:
        parse_sentinel_url(url)
    message = str(caught.value)
    assert "\n" not in message and "expected redis+sentinel://" in message
    with pytest.raises(RedisURLError):
        connect_redis(url)  # the same error from every entry point, before any connection
    assert isinstance(caught.value, PipelineError) and isinstance(caught.value, ValueError)


def test_the_password_never_appears_in_an_error() -> None:
    with pytest.raises(RedisURLError) as caught:
        parse_sentinel_url("redis+sentinel://:hunter2@h:1/m/x")
    assert "hunter2" not in str(caught.value) and "***@" in str(caught.value)
    assert redacted("redis+sentinel://:hunter2@h1:1,h2:2/m/3") == "redis+sentinel://:***@h1:1,h2:2/m/3"
    assert "hunter2" not in redacted("redis+sentinel://:hunter2@[::1:5/m")


def test_plain_urls_are_not_sentinel_urls() -> None:
    for url in ("redis://h:1/0", "rediss://h:1/0", "unix:///s.sock"):
        assert not is_sentinel_url(url)


def test_the_client_asks_the_sentinels_for_the_master_with_the_urls_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINE_REDIS_PASSWORD", raising=False)
    monkeypatch.setenv("PIPELINE_REDIS_SENTINEL_PASSWORD", "sentinel-secret")
    client = connect_redis("redis+sentinel://:data-secret@s1:1,s2:2/prod/3", reconnect_for_s=5)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "prod" and pool.is_master
    assert pool.connection_class is FailoverConnection
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "data-secret"
    assert pool.connection_kwargs["retry"]._retries > 1  # commands ride out the failover
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("s1", 1), ("s2", 2)]
    assert all(s.connection_pool.connection_kwargs["password"] == "sentinel-secret" for s in sentinels)


def test_password_and_tls_variables_apply_as_for_plain_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REDIS_PASSWORD", "from-env")
    monkeypatch.setenv("PIPELINE_REDIS_TLS_CA", "/etc/ca.pem")
    monkeypatch.delenv("PIPELINE_REDIS_SENTINEL_PASSWORD", raising=False)
    assert client_kwargs("rediss+sentinel://s:1/m")["password"] == "from-env"
    assert "password" not in client_kwargs("redis+sentinel://:inurl@s:1/m")  # the URL's own password wins
    assert "ssl_ca_certs" not in client_kwargs("redis+sentinel://s:1/m")
    client = connect_redis("rediss+sentinel://s:1/m")
    pool = client.connection_pool
    assert pool.connection_class is FailoverSSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem" and pool.connection_kwargs["password"] == "from-env"
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    assert sentinel.connection_class is redis.SSLConnection
    assert sentinel.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert sentinel.connection_kwargs.get("password") is None  # the sentinels' password is their own variable
