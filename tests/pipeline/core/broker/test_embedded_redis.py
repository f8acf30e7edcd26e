"""The embedded default: a real redis-server on a unix socket under the state directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from pipeline.core.broker.redis_server import RedisServer
from tests.conftest import PIPELINE


def test_commands_share_one_embedded_server(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "PIPELINE_HOME": str(tmp_path / "home")}
    env.pop("PIPELINE_REDIS_URL", None)
    started = subprocess.run([*PIPELINE, "redis", "start"], env=env, capture_output=True, text=True, check=True)
    assert started.stderr.count("started the embedded Redis server") == 1  # said once, on stderr
    directory = tmp_path / "home" / "redis"
    password = (directory / "password").read_text().strip()
    # `start` never prints the password (a terminal's scrollback, a CI log); it says where the whole URL is.
    assert password not in started.stdout + started.stderr
    assert started.stdout.strip() == f"unix://{directory / 'redis.sock'}?password=***"
    assert "`pipeline redis url`" in started.stderr
    url = subprocess.run([*PIPELINE, "redis", "url"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert url == f"unix://{directory / 'redis.sock'}?password={password}"
    # The password is private to its owner, and the server refuses anyone without it.
    assert (directory / "password").stat().st_mode & 0o777 == 0o600
    assert (directory / "redis.conf").stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    try:
        redis.Redis(unix_socket_path=str(directory / "redis.sock")).ping()
        raise AssertionError("the embedded server answered without a password")
    except redis.AuthenticationError:
        pass
    try:
        client = redis.Redis.from_url(url)
        client.set("marker", "1")
        # A second command reuses the same server instead of starting another.
        again = subprocess.run([*PIPELINE, "redis", "start"], env=env, capture_output=True, text=True, check=True)
        assert again.stdout == started.stdout and "embedded Redis" not in again.stderr
        assert client.get("marker") == b"1"
        status = subprocess.run([*PIPELINE, "status"], env=env, capture_output=True, text=True, check=True)
        assert "workers: 0 live" in status.stdout and status.stderr == ""
        assert "desired: running, weights v0 (generation 0)" in status.stdout
        # Unix socket only: no TCP port is open.
        assert client.config_get("port")["port"] == "0"
        assert client.config_get("appendonly")["appendonly"] == "yes"
        # The stated default (docs/durability.md): a Redis crash loses nothing acknowledged.
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"
    finally:
        stopped = subprocess.run([*PIPELINE, "redis", "stop"], env=env, capture_output=True, text=True, check=True)
    assert stopped.stdout.strip() == "stopped"
    assert not RedisServer(directory, password=password).is_running()


def test_stopping_the_embedded_server_under_live_workers_is_refused_unless_forced(tmp_path: Path) -> None:
    """`pipeline redis stop` with a worker on it would leave that worker retrying a Redis that is gone
    (issue 45): it is refused, naming the worker; `--force` stops it, and the worker still exits when told."""
    import os
    import signal

    from pipeline.core.broker import registry
    from pipeline.core.command import EXIT_UNREACHABLE, EXIT_USAGE
    from tests.helpers.processes import wait_until

    env = {**os.environ, "PIPELINE_HOME": str(tmp_path / "home")}
    env.pop("PIPELINE_REDIS_URL", None)
    subprocess.run([*PIPELINE, "redis", "start"], env=env, capture_output=True, check=True)
    url = subprocess.run([*PIPELINE, "redis", "url"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", "--heartbeat-interval", "1"], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        client = redis.Redis.from_url(url)
        wait_until(lambda: len(registry.live_workers(client, "default")) == 1, 60, "the worker to register")
        wait_until(lambda: "Listening on" in log.read_text(), 60, "the worker's loop")
        (worker_id,) = [w.worker_id for w in registry.live_workers(client, "default")]
        refused = subprocess.run([*PIPELINE, "redis", "stop"], env=env, capture_output=True, text=True)
        assert refused.returncode == EXIT_USAGE and worker_id in refused.stderr and "--force" in refused.stderr
        assert client.ping()  # still up
        forced = subprocess.run([*PIPELINE, "redis", "stop", "--force"], env=env, capture_output=True, text=True)
        assert forced.returncode == 0 and forced.stdout.strip() == "stopped"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == EXIT_UNREACHABLE
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        subprocess.run([*PIPELINE, "redis", "stop", "--force"], env=env, capture_output=True, text=True)


def test_the_fsync_policy_is_chosen_when_the_server_starts_and_a_typo_is_refused(tmp_path: Path) -> None:
    """`PIPELINE_REDIS_APPENDFSYNC=always` starts the embedded server fsyncing every write (a power
    cut loses nothing acknowledged); a value Redis does not know is refused before anything starts."""
    import os

    env = {**os.environ, "PIPELINE_HOME": str(tmp_path / "home"), "PIPELINE_REDIS_APPENDFSYNC": "sometimes"}
    env.pop("PIPELINE_REDIS_URL", None)
    refused = subprocess.run([*PIPELINE, "redis", "start"], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "PIPELINE_REDIS_APPENDFSYNC='sometimes'" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "home" / "redis" / "redis.sock").exists()
    env["PIPELINE_REDIS_APPENDFSYNC"] = "always"
    subprocess.run([*PIPELINE, "redis", "start"], env=env, capture_output=True, check=True)
    url = subprocess.run([*PIPELINE, "redis", "url"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        assert redis.Redis.from_url(url).config_get("appendfsync")["appendfsync"] == "always"
    finally:
        subprocess.run([*PIPELINE, "redis", "stop"], env=env, capture_output=True, check=True)
