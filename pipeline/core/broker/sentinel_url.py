"""Parse Redis Sentinel URLs: `redis+sentinel://[user:password@]host:port[,host:port…]/MASTER_NAME[/DB]`.

`rediss+sentinel://` is the same over TLS (sentinels and data nodes alike). A host without a
port means Sentinel's default port, 26379; IPv6 hosts are written in brackets (`[::1]:26379`).
The password (percent-encoded if it holds `@`, `:`, `/` or `,`) is the data nodes'; sentinels
that need their own take it from `PIPELINE_REDIS_SENTINEL_PASSWORD` (see `pipeline.core.broker.connection`).
Every malformed URL raises `RedisURLError` with one line saying what is wrong and the shape
expected; the password never appears in it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from pipeline.core.errors import RedisURLError

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
SHAPE = "redis+sentinel://[:password@]host:port[,host:port…]/MASTER_NAME[/DB]"
_MASTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class SentinelURL:
    """What a Sentinel URL names: where the sentinels are, which master, which database, how to log in."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    tls: bool
    username: str | None
    password: str | None


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelURL:
    """The parts of a Sentinel URL, or `RedisURLError` saying in one line what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise RedisURLError(f"not a Sentinel URL (scheme {scheme!r}); expected {SHAPE}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    shown = f"{scheme}://{'***@' if at else ''}{hosts}/{path}"

    def fail(what: str) -> RedisURLError:
        return RedisURLError(f"Sentinel URL {shown!r}: {what}; expected {SHAPE}")

    if query or fragment:
        raise fail("query parameters and fragments are not supported (put the password before the @ "
                   "or in PIPELINE_REDIS_PASSWORD)")
    username, password = _credentials(userinfo) if at else (None, None)
    sentinels = tuple(_host_port(item, fail) for item in hosts.split(","))
    segments = path.split("/") if path else []
    if len(segments) == 2 and not segments[1]:
        segments = segments[:1]  # one trailing slash: `/MASTER_NAME/`
    if not segments or not segments[0]:
        raise fail("no master name after the hosts")
    if len(segments) > 2:
        raise fail("too many path segments (only /MASTER_NAME and an optional /DB)")
    master = unquote(segments[0])
    if not _MASTER_NAME.fullmatch(master):
        raise fail(f"master name {master!r} must be letters, digits, '_', '-' or '.'")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise fail(f"database {segments[1]!r} is not a non-negative integer")
        db = int(segments[1])
    return SentinelURL(sentinels, master, db, scheme.lower() == "rediss+sentinel", username, password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # `secret@host`: a bare word before the @ is the password, as redis-py reads `redis://secret@h`
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _host_port(item: str, fail: Callable[[str], RedisURLError]) -> tuple[str, int]:
    if not item:
        raise fail("no sentinel host (or an empty one between commas)")
    if item.startswith("["):
        host, bracket, after = item[1:].partition("]")
        if not bracket or not host:
            raise fail(f"host {item!r} opens an IPv6 bracket it does not close")
        if after and not after.startswith(":"):
            raise fail(f"host {item!r} has text after the IPv6 address that is not ':port'")
        port_text = after[1:] if after else ""
    else:
        host, _, port_text = item.partition(":")
        if ":" in port_text:
            raise fail(f"host {item!r}: write IPv6 addresses in brackets, [::1]:26379")
        if not host:
            raise fail(f"host {item!r} has no host name before the port")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", host):
            raise fail(f"host {item!r} is not a host name or IP address")
    if item.endswith(":"):
        raise fail(f"host {item!r} has an empty port")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise fail(f"port {port_text!r} of {host!r} is not a number from 1 to 65535")
    return host, int(port_text)
