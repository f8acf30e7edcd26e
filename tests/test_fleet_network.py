"""The pipeline across hosts on a network that fails: network namespaces joined by a bridge stand for
hosts (tests/helpers/netns_fleet.py). Redis's master, its replica and three sentinels on three hosts,
a sim worker on each of two more, the trainer (`pipeline submit --wait`) on the third. Faults while
work runs: a worker's host cut off past its lease, then healed; the master's host cut off (the
sentinels promote the replica) and healed (it rejoins as a replica). After each, every request is
one row, nothing is duplicated, and every process stops within seconds of SIGTERM. Skipped, saying
why, where namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipeline
from pipeline.core.broker import connection
from tests.conftest import PIPELINE
from tests.helpers import agents, fleet_redis, netns_fleet
from tests.helpers.netns_fleet import Fleet, redis_binary
from tests.helpers.processes import stop_all, wait_until

HOSTS = ["redis-a", "redis-b", "trainer", "gpu-1", "gpu-2", "serve"]
REQUESTS, BATCH = 160, 8
# A lease: a worker's job is taken for abandoned 3 heartbeats + 1 s after its last heartbeat.
HEARTBEAT_S = 0.5

pytestmark = pytest.mark.skipif(netns_fleet.unavailable() is not None, reason=netns_fleet.unavailable() or "")


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """The fleet, Redis's group up; a test marked `redis_args(...)` gives its servers those settings."""
    marker = request.node.get_closest_marker("redis_args")
    fleet = Fleet(HOSTS).up()
    try:
        fleet_redis.start_group(fleet, tmp_path, list(marker.args) if marker else [])
        yield fleet
    finally:
        fleet.down()


def _start_worker(fleet: Fleet, tmp_path: Path, host: str) -> None:
    fleet_redis.start_worker(fleet, tmp_path, host, heartbeat_s=HEARTBEAT_S)


def _start_work(fleet: Fleet, tmp_path: Path, workers: tuple[str, ...]) -> object:
    """Sim workers on `workers`' hosts, and the trainer's `pipeline submit --wait` (its process)."""
    env = fleet_redis.pipeline_env(fleet, tmp_path)
    for host in workers:
        _start_worker(fleet, tmp_path, host)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": [5, 6, 7],
                                            "sampling_params": {"max_new_tokens": 64}}) + "\n"
                                for i in range(REQUESTS)))
    trainer = fleet.start("trainer", [*PIPELINE, "submit", str(requests), "--run", "net", "--batch-size", str(BATCH),
                                      "--wait", "--timeout", "300"], env=env, log=tmp_path / "trainer.log")
    return trainer


def _worker_states(fleet: Fleet, tmp_path: Path) -> dict[str, str]:
    """Each live worker's registry state, read from the trainer's host."""
    code = "import json, pipeline; print(json.dumps({w.worker_id: w.state for w in pipeline.connect().workers()}))"
    out = fleet.run("trainer", [sys.executable, "-c", code], env=fleet_redis.pipeline_env(fleet, tmp_path), timeout=60)
    return json.loads(out) if out.strip() else {}


def _shards(tmp_path: Path) -> int:
    return len(list((tmp_path / "shards").rglob("*.parquet"))) if (tmp_path / "shards").exists() else 0


def _check_rows_and_stop(fleet: Fleet, tmp_path: Path, trainer: object) -> None:
    """Every request one row, every process stopped within 20 s of SIGTERM."""
    wait_until(lambda: trainer.poll() is not None, 300, "the trainer's submit to finish")  # type: ignore[attr-defined]
    assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()  # type: ignore[attr-defined]
    ids = pipeline.read_rollouts(str(tmp_path / "shards"), "net").column("request_id").to_pylist()
    assert sorted(ids) == sorted(f"q{i}" for i in range(REQUESTS)), "a request missing or run twice"
    # Pipeline processes first (they leave Redis's registry on the way out), then Redis.
    stuck = stop_all([p for p in fleet.processes if "pipeline.cli.main" in p.args], timeout=20)
    stuck += fleet.down()
    assert stuck == [], f"{len(stuck)} process(es) did not stop within 20 s of SIGTERM: {[p.args for p in stuck]}"


def test_a_workers_host_cut_off_past_its_lease_then_healed(fleet: Fleet, tmp_path: Path) -> None:
    trainer = _start_work(fleet, tmp_path, ("gpu-1",))
    wait_until(lambda: _shards(tmp_path) >= 3, 120, "work under way on gpu-1")
    # gpu-1 holds the rest of the run (the sim takes every job at once); gpu-2 joins and gpu-1 is cut off.
    _start_worker(fleet, tmp_path, "gpu-2")
    fleet.cut("gpu-1")
    assert trainer.poll() is None, "the run ended before the fault"  # type: ignore[attr-defined]
    # The run finishes without gpu-1: its jobs in hand are taken for abandoned once its lease ran out
    # and run again on gpu-2.
    wait_until(lambda: trainer.poll() is not None, 300, "the run to finish on the host still connected")
    fleet.heal("gpu-1")
    # Back on the network, gpu-1 drops the jobs it held (others ran them) and takes work again.
    wait_until(lambda: _worker_states(fleet, tmp_path).get("gpu-1") == "idle", 120, "gpu-1 back and idle")
    # (The run finished while gpu-1 was cut off: its jobs ran on gpu-2. gpu-1's late copies rewrite the
    # same shards, so which worker a row names is whichever wrote last.)
    _check_rows_and_stop(fleet, tmp_path, trainer)


def test_the_masters_host_cut_off_fails_over_and_rejoins_as_a_replica(fleet: Fleet, tmp_path: Path) -> None:
    trainer = _start_work(fleet, tmp_path, ("gpu-1", "gpu-2"))
    wait_until(lambda: _shards(tmp_path) >= 3, 120, "work under way")
    fleet.cut("redis-a")
    assert trainer.poll() is None, "the run ended before the fault"  # type: ignore[attr-defined]
    fleet_redis.wait_for_promotion(fleet, tmp_path)
    wait_until(lambda: _shards(tmp_path) >= 6, 120, "work committing on the new master")
    fleet.heal("redis-a")
    wait_until(lambda: fleet_redis.in_sync(fleet, "redis-a"), 60, "the old master to rejoin as a replica, in sync")
    _check_rows_and_stop(fleet, tmp_path, trainer)


FOLLOWER = """
from pipeline.core.broker.connection import connect_redis
print(connect_redis().blpop(["dead-peer"], timeout=0)[1].decode(), flush=True)
"""


def test_a_client_waiting_on_the_cut_off_master_follows_the_failover(fleet: Fleet, tmp_path: Path) -> None:
    """A blocking read in flight to the master when its host is cut off: no reset ever comes from a
    host cut off, yet the client drops that connection (keepalive, TCP_USER_TIMEOUT) and reads on
    the promoted master, instead of waiting out its socket timeout (none here: the kernel's
    retransmissions, a quarter of an hour)."""
    log = tmp_path / "follower.log"
    follower = fleet.start("trainer", [sys.executable, "-c", FOLLOWER], env=fleet_redis.pipeline_env(fleet, tmp_path),
                           log=log)
    cli = [redis_binary("redis-cli"), "-h", fleet.ip("redis-a")]
    wait_until(lambda: "cmd=blpop" in fleet.run("trainer", [*cli, "client", "list"]), 60, "the follower's BLPOP")
    fleet.cut("redis-a")
    fleet_redis.wait_for_promotion(fleet, tmp_path)
    fleet.run("trainer", [redis_binary("redis-cli"), "-h", fleet.ip("redis-b"), "rpush", "dead-peer", "followed"])
    wait_until(lambda: follower.poll() is not None, 60, "the follower to read on the promoted master")
    assert log.read_text().split() == ["followed"], log.read_text()


def _refused_writes(fleet: Fleet) -> int:
    """Writes the master refused with NOREPLICAS so far."""
    info = fleet.run("redis-a", [redis_binary("redis-cli"), "info", "errorstats"])
    for line in info.splitlines():
        if line.startswith("errorstat_NOREPLICAS:count="):
            return int(line.split("=")[1].split(",")[0])
    return 0


@pytest.mark.skipif(not hasattr(connection, "is_unavailable"),
                    reason="needs workers that wait out NOREPLICAS (the redisretry change, issue 58)")
@pytest.mark.redis_args("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
def test_the_masters_replica_cut_off_is_waited_out(fleet: Fleet, tmp_path: Path) -> None:
    """The master cannot reach a replica: it refuses writes (NOREPLICAS) and, the sentinels seeing it
    alive, no failover happens. The workers wait, and carry on once the replica is back."""
    trainer = _start_work(fleet, tmp_path, ("gpu-1", "gpu-2"))
    wait_until(lambda: _shards(tmp_path) >= 3, 120, "work under way")
    fleet.cut("redis-b")
    assert trainer.poll() is None, "the run ended before the fault"  # type: ignore[attr-defined]
    wait_until(lambda: _refused_writes(fleet) >= 20, 120, "the master to refuse writes")
    workers = [p for p in fleet.processes if "worker" in p.args]
    assert all(p.poll() is None for p in workers), "a worker quit on NOREPLICAS"
    fleet.heal("redis-b")
    wait_until(lambda: trainer.poll() is not None, 300, "the trainer's submit to finish")  # type: ignore[attr-defined]
    assert fleet_redis.master(fleet) == fleet.ip("redis-a"), "a failover happened"
    _check_rows_and_stop(fleet, tmp_path, trainer)
    for host in ("gpu-1", "gpu-2"):
        errors = [line for line in (tmp_path / f"{host}-worker.log").read_text().splitlines() if " ERROR " in line]
        assert errors == [], f"{host}: a refused write failed work instead of being waited out: {errors[:3]}"


def test_a_partition_that_outlasts_every_lease_waits_and_resumes(fleet: Fleet, tmp_path: Path) -> None:
    """Both workers' hosts cut off until their registry entries expired: the work waits, and once healed
    it resumes and finishes, each request one row."""
    trainer = _start_work(fleet, tmp_path, ("gpu-1", "gpu-2"))
    wait_until(lambda: _shards(tmp_path) >= 3, 120, "work under way")
    fleet.cut("gpu-1")
    fleet.cut("gpu-2")
    wait_until(lambda: _worker_states(fleet, tmp_path) == {}, 120, "every worker's lease to run out")
    assert trainer.poll() is None  # type: ignore[attr-defined]
    fleet.heal("gpu-1")
    fleet.heal("gpu-2")
    _check_rows_and_stop(fleet, tmp_path, trainer)


def test_the_trainers_host_cut_off_mid_submit(fleet: Fleet, tmp_path: Path) -> None:
    """The trainer (and one sentinel) cut off while its `submit --wait` waits: the workers carry on, and
    the submit, back on the network, finishes with every row."""
    trainer = _start_work(fleet, tmp_path, ("gpu-1", "gpu-2"))
    wait_until(lambda: _shards(tmp_path) >= 3, 120, "work under way")
    fleet.cut("trainer")
    assert trainer.poll() is None, "the run ended before the fault"  # type: ignore[attr-defined]
    wait_until(lambda: _shards(tmp_path) >= REQUESTS // BATCH, 120, "the run to finish while its trainer is away")
    fleet.heal("trainer")
    _check_rows_and_stop(fleet, tmp_path, trainer)


AGENT = "tests.helpers.agents:solve"
TASKS, SAMPLES = 8, 2
EPISODES_PROBE = """
import json, pipeline
from pipeline.core.jobs import episodes
conn = pipeline.connect().conn
groups = pipeline.read_trajectories("eps", conn=conn, groups=True)
print(json.dumps({"outcomes": sorted(episodes.outcomes(conn, "eps")),
                  "groups": [g.column("task_id").to_pylist() for g in groups]}))
"""


def _agent_worker_registered(fleet: Fleet) -> bool:
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-h", fleet_redis.master(fleet), "--scan", "--pattern",
                                "*agent-worker:serve-agent"])
    return bool(out.strip())


def test_serves_host_cut_off_mid_episode(fleet: Fleet, tmp_path: Path) -> None:
    """`pipeline serve` and its agent worker on one host, cut off from Redis and the GPU workers with
    episodes in flight until the agent worker's registry entry expired, then healed: every episode
    ends once, one trajectory each."""
    env = fleet_redis.pipeline_env(fleet, tmp_path)
    events = tmp_path / "events.jsonl"
    env.update(PIPELINE_TEST_AGENT_EVENTS=str(events), PIPELINE_SERVE_API_KEY="fleet-key")
    for host in ("gpu-1", "gpu-2"):
        _start_worker(fleet, tmp_path, host)
    serve_url = f"http://{fleet.ip('serve')}:8000"
    fleet.start("serve", [*PIPELINE, "serve", "--host", "0.0.0.0", "--port", "8000", "--api-key", "fleet-key",
                          "--run", "eps", "--turn-timeout", "60"], env=env, log=tmp_path / "serve.log")
    fleet.start("serve", [*PIPELINE, "agent-worker", "--agent", AGENT, "--serve", serve_url, "--concurrency", "4",
                          "--claim-after", "2", "--worker-id", "serve-agent"], env=env, log=tmp_path / "agent.log")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": [5 + i, 6, 7], "turns": 4, "answer": i % 2,
                                         "turn_s": 0.2}) + "\n" for i in range(TASKS)))
    trainer = fleet.start("trainer", [*PIPELINE, "submit", str(tasks), "--agent", AGENT, "--n", str(SAMPLES),
                                      "--run", "eps", "--retries", "5", "--wait", "--timeout", "300"],
                          env=env, log=tmp_path / "trainer.log")
    wait_until(lambda: sum(e["kind"] == "end" for e in agents.events(events)) >= 3, 180, "episodes under way")
    assert trainer.poll() is None, "the run ended before the fault"
    fleet.cut("serve")
    wait_until(lambda: not _agent_worker_registered(fleet), 120, "the agent worker's entry to expire")
    fleet.heal("serve")
    wait_until(lambda: trainer.poll() is not None, 300, "the episodes to finish")
    assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()
    result = json.loads(fleet.run("trainer", [sys.executable, "-c", EPISODES_PROBE], env=env, timeout=60))
    assert result["outcomes"] == sorted(f"t{i}:{s}" for i in range(TASKS) for s in range(SAMPLES))
    assert result["groups"] == [[f"t{i}"] * SAMPLES for i in range(TASKS)], "an episode missing or twice"
    stuck = stop_all([p for p in fleet.processes if "pipeline.cli.main" in p.args], timeout=20)
    assert stuck == [], f"did not stop within 20 s of SIGTERM: {[p.args for p in stuck]}"
