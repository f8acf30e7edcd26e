"""Small helpers the benchmark scripts share: a free loopback port, a percentile, a `pipeline serve`
coming up with its workers, processes stopped."""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0-1) of `values`: the value at rank q·n, the last one for q = 1."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_for_serve(url: str, workers: int, timeout_s: float = 120) -> None:
    """Until `pipeline serve` at `url` answers and `workers` workers have joined its pool."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).json()["live_workers"] >= workers:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("pipeline serve or its workers did not come up")
        time.sleep(0.2)


def stop_processes(procs: list[Any]) -> None:
    """SIGTERM each `multiprocessing` process still alive (a warm shutdown), then join them."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.join(timeout=15)
