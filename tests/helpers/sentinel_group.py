"""A local Sentinel topology of real `redis-server` processes on loopback: a master, replicas, sentinels.

For the failover test, the chaos benchmark (`--kill-master`) and trying Sentinel URLs on one
machine; a deployment runs its own (compose.yaml's `sentinel` profile). The sentinels are the
same binary in sentinel mode (`redis-server sentinel.conf --sentinel`): each declares the master
down after `down_after_ms` without an answer, and `quorum` of them agree to promote a replica.
`kill_master()` SIGKILLs whichever server is master now; `restart(port)` brings a killed server
back, and the sentinels turn it into a replica of the new master. `demote_master()` has the
sentinels fail over from a master that still runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from pipeline.core.broker.redis_server import RedisServer, _write_private, find_redis_server
from pipeline.core.errors import EmbeddedRedisError
from tests.helpers.processes import free_port

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SentinelGroup:
    """One master, `replicas` replicas and `sentinels` sentinels, each its own process under `directory`."""

    def __init__(
        self, directory: Path, *, replicas: int = 1, sentinels: int = 3, master_name: str = "pipeline",
        password: str | None = None, down_after_ms: int = 500, failover_timeout_ms: int = 2000,
        appendfsync: str = "everysec",
    ) -> None:
        self.directory = Path(directory)
        self.master_name = master_name
        self.password = password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        first = free_port()
        self.servers = {first: RedisServer(self.directory / "server-0", port=first, password=password,
                                           appendfsync=appendfsync)}
        for index in range(1, replicas + 1):
            port = free_port()
            self.servers[port] = RedisServer(self.directory / f"server-{index}", port=port, password=password,
                                             appendfsync=appendfsync, replica_of=first)
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.quorum = sentinels // 2 + 1

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{auth}{hosts}/{self.master_name}/0"

    def _sentinel_dir(self, index: int) -> Path:
        return self.directory / f"sentinel-{index}"

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2, socket_timeout=2)

    def start(self) -> str:
        """Start every process and wait until each sentinel sees the master, the replicas and the other
        sentinels (only then can it fail over); return the Sentinel URL. On failure nothing is left running."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        for server in self.servers.values():
            server.ensure_started()
        first = next(iter(self.servers))
        binary = find_redis_server()
        for index, port in enumerate(self.sentinel_ports):
            directory = self._sentinel_dir(index)
            directory.mkdir(parents=True, exist_ok=True)
            name = self.master_name
            lines = [
                f"port {port}", "bind 127.0.0.1", "daemonize yes", f"dir {directory}",
                f"pidfile {directory / 'sentinel.pid'}", f"logfile {directory / 'sentinel.log'}",
                f"sentinel monitor {name} 127.0.0.1 {first} {self.quorum}",
                f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {name} 1",
            ]
            if self.password:
                lines.append(f"sentinel auth-pass {name} {self.password}")
            config = directory / "sentinel.conf"
            _write_private(config, "\n".join(lines) + "\n")
            result = subprocess.run([binary, str(config), "--sentinel"], capture_output=True, text=True)
            if result.returncode != 0:
                raise EmbeddedRedisError(f"sentinel on port {port} failed to start: {result.stderr or result.stdout}")
        self.wait_ready()
        return self.url

    def wait_ready(self, replicas: int | None = None, timeout: float = READY_TIMEOUT_S) -> None:
        """Until a majority of the sentinels (what an election needs) name the same live master, know
        the other sentinels and see `replicas` (default: all) replicas linked to it, and the master
        reports them online: a failover can happen. (After a failover a sentinel can take minutes to
        refresh its view of a replica; the majority does not wait for it.)"""
        want = len(self.servers) - 1 if replicas is None else replicas
        deadline = time.monotonic() + timeout
        while True:
            views: list[tuple[int, int, int] | None] = []  # (master port, other sentinels, linked replicas)
            for port in self.sentinel_ports:
                try:
                    sentinel = self._sentinel(port)
                    master = sentinel.sentinel_master(self.master_name)
                    linked = [r for r in sentinel.sentinel_slaves(self.master_name)
                              if not (r["is_sdown"] or r["is_odown"] or r["is_disconnected"])
                              and r.get("master-link-status") == "ok"]
                    down = master["is_sdown"] or master["is_odown"]
                    views.append(None if down else (master["port"], master["num-other-sentinels"], len(linked)))
                except (redis.RedisError, OSError):
                    views.append(None)
            ready = [v for v in views if v is not None and v[1] >= len(views) - 1 and v[2] >= want]
            ports = {v[0] for v in ready}
            if len(ready) > len(views) // 2 and len(ports) == 1 and self._has_replicas(ports.pop(), want):
                return
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"the Sentinel group was not ready within {timeout}s "
                                         f"(per sentinel: master port, other sentinels, linked replicas: {views}); "
                                         f"see the logs under {self.directory}")
            time.sleep(0.1)

    def _has_replicas(self, port: int, count: int) -> bool:
        """The master reports `count` replicas online (so a failover has somewhere to go)."""
        try:
            info = self.servers[port].client().info("replication")
        except (redis.RedisError, OSError):
            return False
        online = sum(1 for key, value in info.items()
                     if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")
        return info.get("role") == "master" and online >= count

    def master_port(self) -> int:
        """The port of the server the sentinels name as master now."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError):
                address = self._sentinel(port).sentinel_get_master_addr_by_name(self.master_name)
                if address:
                    return int(address[1])
        raise EmbeddedRedisError(f"no sentinel of {self.directory} names a master")

    def kill_master(self) -> int:
        """SIGKILL the current master (no shutdown, no save: a dead machine); return its port."""
        port = self.master_port()
        pid = int((self.servers[port].directory / "redis.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        return port

    def demote_master(self, timeout: float = READY_TIMEOUT_S) -> int:
        """Have the sentinels promote a replica while the master still runs (`SENTINEL FAILOVER`, as
        an operator does, and as sentinels do to a master that stops answering their pings for a
        while): it answers, and takes writes the promotion loses, until they turn it into a replica.
        Returns its port."""
        port = self.master_port()
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sentinel(self.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", self.master_name)
                return port
            except redis.ResponseError as error:  # INPROG, NOGOODSLAVE: an earlier failover still settling
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(f"the sentinels refused to fail over from port {port}: {error}") from None
                time.sleep(0.2)

    def wait_for_failover(self, old_port: int, timeout: float = READY_TIMEOUT_S) -> int:
        """Until the sentinels name another master, and it answers as one; return its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(EmbeddedRedisError, redis.RedisError, OSError):
                port = self.master_port()
                if port != old_port and self.servers[port].client().info("replication").get("role") == "master":
                    return port
            time.sleep(0.05)
        raise EmbeddedRedisError(f"no failover away from port {old_port} within {timeout}s")

    def restart(self, port: int) -> None:
        """Start a killed server again on its data, as a replica of the current master (as the
        sentinels would reconfigure it; a server restarted as a master with stale data could take
        writes until they noticed)."""
        server = self.servers[port]
        server.replica_of = self.master_port()
        server.ensure_started()

    def stop(self) -> None:
        """SIGKILL every process of the group (sentinels and servers, whatever state they are in) and
        wait until they are gone: nothing of a test's or benchmark's group outlives it."""
        pidfiles = [self._sentinel_dir(index) / "sentinel.pid" for index in range(len(self.sentinel_ports))]
        pidfiles += [server.directory / "redis.pid" for server in self.servers.values()]
        pids = []
        for pidfile in pidfiles:
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                # A killed server leaves its pidfile: only a process running in that directory is ours.
                if Path(f"/proc/{pid}/cwd").resolve() == pidfile.parent.resolve():
                    os.kill(pid, signal.SIGKILL)
                    pids.append(pid)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def __enter__(self) -> SentinelGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
