"""Exactly once per episode, whatever dies: real processes (redis-server, `pipeline serve`, two sim
GPU workers, two `pipeline agent-worker`s, the real `openai` SDK inside the agents). One agent worker
is SIGKILLed with episodes in flight, `pipeline serve` is SIGKILLed and restarted, a GPU worker is
SIGKILLed mid-turn: every task × sample still yields exactly one trajectory, the abandoned sessions
are counted and none of their turns reaches training, through any reader (plain, grouped, torch)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import redis

import pipeline
from pipeline.core.broker import keys
from pipeline.core.jobs import episodes
from pipeline.read.lineage_rows import turn_rows
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, stop_all, wait_healthy, wait_until

AGENT = "tests.helpers.agents:solve"
TASKS, SAMPLES, TURNS = 10, 2, 4


def _serve(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen([*PIPELINE, "serve", "--port", str(port), "--run", "chaos", "--turn-timeout", "60"],
                               env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", process, log, timeout_s=120, what="pipeline serve")
    return process


def _running_on(conn: redis.Redis, worker_id: str) -> int:
    return sum(1 for raw in conn.hvals(keys.episode_attempts("chaos")) if worker_id.encode() in raw)


def _logged_on(conn: redis.Redis, worker_id: str) -> int:
    """How many of the episodes `worker_id` runs now have a turn in the run's turn log."""
    sessions = {attempt["session_id"] for attempt in map(json.loads, conn.hvals(keys.episode_attempts("chaos")))
                if attempt.get("worker_id") == worker_id}
    return len(sessions & set(turn_rows("chaos", conn).column("session_id").to_pylist()))


def test_every_episode_ends_once_though_an_agent_worker_the_server_and_a_gpu_worker_die(
        redis_client: redis.Redis, pipeline_env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**pipeline_env, "PIPELINE_SERVE_URL": url}
    processes: list[subprocess.Popen] = []

    def start(*args: str, name: str) -> subprocess.Popen:
        process = subprocess.Popen([*PIPELINE, *args], env=env, stdout=(tmp_path / f"{name}.log").open("w"),
                                   stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    serve = _serve(env, port, tmp_path / "serve.log")
    try:
        gpu = [start("worker", "--engine", "sim", "--heartbeat-interval", "0.5", "--sim-step-ms", "20",
                     "--log-level", "WARNING", name=f"gpu{i}") for i in range(2)]
        wait_until(lambda: len(pipeline.Client(redis_client).workers()) == 2, 60, "two GPU workers")
        tasks = [{"id": f"t{i}", "prompt": [5 + i, 6, 7], "turns": TURNS, "answer": i % 2, "turn_s": 0.3}
                 for i in range(TASKS)]
        run = pipeline.Client(redis_client).submit_episodes(tasks, agent=AGENT, run="chaos", n=SAMPLES, retries=5)
        agents = {name: start("agent-worker", "--agent", AGENT, "--concurrency", "6", "--claim-after", "2",
                              "--worker-id", name, "--log-level", "INFO", name=name) for name in ("agent-a", "agent-b")}

        wait_until(lambda: _running_on(redis_client, "agent-a") >= 3, 120, "episodes in flight on agent-a")
        # Killed once a turn of theirs is logged: the readers below must leave out a partial attempt's turns.
        wait_until(lambda: _logged_on(redis_client, "agent-a") >= 1, 120, "a turn of agent-a's episodes logged")
        agents["agent-a"].send_signal(signal.SIGKILL)
        wait_until(lambda: run.counts()["finished"] >= 4, 120, "four episodes finished")
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        serve = _serve(env, port, tmp_path / "serve.log")
        gpu[0].send_signal(signal.SIGKILL)

        counts = run.wait(timeout=300)
    finally:
        stop_all([serve, *processes])

    assert counts["finished"] == TASKS * SAMPLES and counts["failed"] == 0
    assert counts["abandoned"] >= 3  # agent-a's episodes, run again in fresh sessions by agent-b
    outcomes = episodes.outcomes(redis_client, "chaos")
    assert sorted(outcomes) == sorted(f"t{i}:{s}" for i in range(TASKS) for s in range(SAMPLES))
    groups = pipeline.read_trajectories("chaos", conn=redis_client, groups=True)
    assert [g.column("task_id").to_pylist() for g in groups] == [[f"t{i}"] * SAMPLES for i in range(TASKS)]
    committed = {o.session_id for o in outcomes.values()}
    discarded = episodes.discarded_sessions(redis_client, "chaos")
    assert discarded and not committed & discarded
    rows = [r for r in turn_rows("chaos", redis_client).to_pylist() if r["session_id"] in committed]
    per_session = {}
    for row in rows:
        per_session.setdefault(row["session_id"], []).append(row["turn"])
    assert {s: sorted(t) for s, t in per_session.items()} == {s: list(range(TURNS)) for s in committed}
    # Every reader, not only the grouped one, returns exactly the committed episodes: never a partial
    # attempt of the SIGKILLed worker's (its turns were served and logged all the same).
    assert discarded & {r["session_id"] for r in turn_rows("chaos", redis_client).to_pylist()}
    plain = pipeline.read_trajectories("chaos", conn=redis_client)
    assert sorted(plain.column("session_id").to_pylist()) == sorted(committed)
    batches = pipeline.RolloutBatches("chaos", conn=redis_client, trajectories=True, batch_size=8)
    assert sorted(s for batch in batches for s in batch["session_id"]) == sorted(committed)
    for group in groups:
        for item in group.to_pylist():
            assert item["turns"] == list(range(TURNS)) and item["lineages"] == 1
            assert sum(item["loss_mask"]) == TURNS * 4  # max_tokens 4 a turn, every sampled token masked in
