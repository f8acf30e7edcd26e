"""Hosts on one machine: network namespaces joined by a bridge, for tests that cut hosts apart.

Every address and the bridge live inside namespaces the fleet made (the bridge in a "switch"
namespace of its own), so nothing is routed out and the machine's own namespace is untouched.
`Fleet.cut(host)` takes a host's link down at the switch (its processes keep running, unreachable),
`Fleet.heal(host)` brings it back. `Fleet.start(host, ...)` runs a process inside a host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.processes import stop_all

SUBNET = "10.77.0"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root; not root here"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) here"
    probe = f"pfprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def redis_binary(name: str) -> str:
    """redis-server / redis-cli: beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


@dataclass
class Fleet:
    hosts: list[str]
    prefix: str = field(default_factory=lambda: f"pf{os.getpid() % 100000}")
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def _port(self, host: str) -> str:
        return f"{self.prefix}p{self.hosts.index(host)}"

    def up(self) -> Fleet:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns, port = self.ns(host), self._port(host)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
        return self

    def cut(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host), "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host), "up")

    def start(self, host: str, command: list[str], *, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`command` inside `host` (`ip netns exec` execs it: the Popen's pid is the command's)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *command], env=env,
                                   stdout=log.open("a"), stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def run(self, host: str, command: list[str], *, env: dict[str, str] | None = None, timeout: float = 30) -> str:
        result = subprocess.run(["ip", "netns", "exec", self.ns(host), *command], env=env, capture_output=True,
                                text=True, timeout=timeout)
        return result.stdout

    def down(self) -> list[subprocess.Popen]:
        """Stop every process still running (SIGTERM; SIGKILL after 20 s) and delete the namespaces;
        the processes that needed the SIGKILL."""
        for host in self.hosts:
            subprocess.run(["ip", "-n", self.switch, "link", "set", self._port(host), "up"], capture_output=True)
        stuck = stop_all(self.processes, timeout=20)
        for ns in [self.ns(h) for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        return stuck


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
