"""A `pipeline worker` whose Redis is gone still stops when told (real redis-server, real worker
process): every Redis command retries for `PIPELINE_REDIS_RECONNECT_S` (a minute) to ride out a
restart, but a worker told to stop gives up on Redis within `PIPELINE_STOPPING_RECONNECT_S` and exits,
saying why, instead of retrying through its whole shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.core.broker import registry
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.command import EXIT_UNREACHABLE
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, log_tail, wait_until

SIM = ["--engine", "sim", "--sim-step-ms", "1", "--heartbeat-interval", "1"]


@pytest.mark.parametrize("signals", [1, 2])
def test_a_worker_whose_redis_is_gone_exits_when_told(tmp_path: Path, signals: int) -> None:
    server = RedisServer(tmp_path / "redis", port=free_port())
    server.ensure_started()
    log = tmp_path / "worker.log"
    # With two signals the first one's give-up window is long, so the second surely lands in it
    # (a loaded machine once saw 5 s pass before it did).
    env = {**os.environ, "PIPELINE_STOPPING_RECONNECT_S": "5" if signals == 1 else "120"}
    worker = subprocess.Popen([*PIPELINE, "worker", *SIM, "--redis", server.url, "--pool", "gone"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_until(lambda: len(registry.live_workers(server.client(), "gone")) == 1, 60, "the worker to register")
        wait_until(lambda: "Listening on" in log.read_text(), 60, "the worker's loop (its signal handlers)")
        server.stop()  # returns once the port refuses connections
        worker.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_until(lambda: "warm shut down requested" in log.read_text(), 30, "the first signal's effect")
            time.sleep(1.1)  # RQ takes a second signal within a second of the first for the same one
            worker.send_signal(signal.SIGTERM)
        # Without giving up, the shutdown retries each of its Redis writes for a minute: minutes in all
        # (before the fix, still alive 70 s after SIGTERM, SIGTERM, SIGINT).
        returncode = worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    text = log.read_text()
    if signals == 1:  # the warm shutdown's Redis writes given up on: it says so
        assert returncode == EXIT_UNREACHABLE, log_tail(log)
        assert "Redis unreachable" in text and "runs again on another worker" in text
    else:  # the second signal exits now (1), as with Redis up
        assert returncode == 1 and "second shutdown signal; exiting now" in text, log_tail(log)
