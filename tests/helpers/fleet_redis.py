"""Redis across the hosts of a `netns_fleet.Fleet`: a master on "redis-a", its replica on "redis-b",
three sentinels (on "redis-a", "redis-b" and "trainer") watching master `pipeline` with quorum 2,
and the pipeline's processes pointed at them by a Sentinel URL. Shared by
tests/test_fleet_network.py and benchmarks/failover_hosts.py."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import PIPELINE
from tests.helpers.netns_fleet import Fleet, redis_binary
from tests.helpers.processes import wait_until

ROOT = Path(__file__).resolve().parents[2]
SENTINELS = ["redis-a", "redis-b", "trainer"]
DOWN_AFTER_MS = 1000  # a sentinel takes the master for down after this long without an answer
FAILOVER_TIMEOUT_MS = 5000


def start_group(fleet: Fleet, tmp_path: Path, extra: list[str]) -> None:
    """The master, its replica and the sentinels, each server with `extra` settings; returns once
    the sentinels see the replica."""
    master = fleet.ip("redis-a")
    for host in ("redis-a", "redis-b"):
        data = tmp_path / host
        data.mkdir()
        command = [redis_binary("redis-server"), "--port", "6379", "--bind", "0.0.0.0", "--protected-mode", "no",
                   "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data),
                   "--replica-announce-ip", fleet.ip(host), *extra]
        if host != "redis-a":
            command += ["--replicaof", master, "6379"]
        fleet.start(host, command, log=tmp_path / f"{host}-redis.log")
    for host in SENTINELS:
        conf = tmp_path / f"{host}-sentinel.conf"
        conf.write_text(f"port 26379\nbind 0.0.0.0\nprotected-mode no\nsentinel announce-ip {fleet.ip(host)}\n"
                        f"sentinel monitor pipeline {master} 6379 2\n"
                        f"sentinel down-after-milliseconds pipeline {DOWN_AFTER_MS}\n"
                        f"sentinel failover-timeout pipeline {FAILOVER_TIMEOUT_MS}\n")
        fleet.start(host, [redis_binary("redis-server"), str(conf), "--sentinel"],
                    log=tmp_path / f"{host}-sentinel.log")
    wait_until(lambda: replicas_seen(fleet) == 1, 60, "the sentinels to see the master and its replica")
    # Sentinels find each other through the master (a hello every 2 s): a master cut off before they
    # have is never failed over (no quorum), as a loaded CI run found.
    wait_until(lambda: all(other_sentinels(fleet, host) == len(SENTINELS) - 1 for host in SENTINELS), 60,
               "the sentinels to know each other")


def other_sentinels(fleet: Fleet, host: str) -> int:
    """How many other sentinels the sentinel on `host` knows of."""
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-h", fleet.ip(host), "-p", "26379", "sentinel",
                                "sentinels", "pipeline"])
    return out.split("\n").count("flags")


def replicas_seen(fleet: Fleet) -> int:
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-p", "26379", "sentinel", "replicas", "pipeline"])
    return out.count("flags\nslave\n") if "flags" in out else 0


def master(fleet: Fleet) -> str:
    """The master's address, as the trainer's host's sentinel names it."""
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-p", "26379", "sentinel", "get-master-addr-by-name",
                                "pipeline"])
    return out.split("\n")[0]


# Sentinel's own election can take tens of seconds: a split vote is retried after twice the failover
# timeout, and a sentinel whose timer jumped (a loaded host) sits out 30 s in TILT mode.
PROMOTION_WAIT_S = 150.0


def wait_for_promotion(fleet: Fleet, tmp_path: Path, host: str = "redis-b") -> None:
    """Until the sentinels name `host` master; on a timeout the error carries each sentinel's log tail."""
    try:
        wait_until(lambda: master(fleet) == fleet.ip(host), PROMOTION_WAIT_S, f"the sentinels to promote {host}")
    except AssertionError as error:
        tails = {h: (tmp_path / f"{h}-sentinel.log").read_text().splitlines()[-15:] for h in SENTINELS
                 if (tmp_path / f"{h}-sentinel.log").exists()}
        raise AssertionError(f"{error}; sentinel logs: " + "\n".join(f"{h}:\n" + "\n".join(lines)
                                                                    for h, lines in tails.items())) from None


def in_sync(fleet: Fleet, host: str) -> bool:
    """A replica linked to its master, its first append-only file after the full sync written (Redis
    6.2 drops a SIGTERM that comes while it writes that file: "Writing initial AOF, can't exit")."""
    info = fleet.run(host, [redis_binary("redis-cli"), "info"])
    return all(line in info.splitlines() for line in ("role:slave", "master_link_status:up",
                                                      "aof_rewrite_in_progress:0", "aof_rewrite_scheduled:0"))


def pipeline_env(fleet: Fleet, tmp_path: Path) -> dict[str, str]:
    """The environment of a pipeline process in the fleet: the Sentinel URL, shards under `tmp_path`."""
    sentinels = ",".join(f"{fleet.ip(h)}:26379" for h in SENTINELS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_REDIS_URL": f"redis+sentinel://{sentinels}/pipeline/0",
           "PIPELINE_OUTPUT": str(tmp_path / "shards"), "PIPELINE_REDIS_RECONNECT_S": "120"}
    env.pop("PIPELINE_CONTROL_SECRET", None)
    return env


def start_worker(fleet: Fleet, tmp_path: Path, host: str, *, heartbeat_s: float, sim_step_ms: int = 40) -> None:
    """A sim worker on `host`, named after it, logging to `tmp_path`/HOST-worker.log."""
    fleet.start(host, [*PIPELINE, "worker", "--engine", "sim", "--sim-step-ms", str(sim_step_ms),
                       "--heartbeat-interval", str(heartbeat_s), "--worker-id", host],
                env=pipeline_env(fleet, tmp_path), log=tmp_path / f"{host}-worker.log")
