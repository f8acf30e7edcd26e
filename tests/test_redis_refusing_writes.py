"""Every long-lived process waits out a Redis that refuses writes (a master cut off from its
replicas answers `NOREPLICAS`) as it waits out a lost connection: real redis-server, real
`pipeline serve`, sim `pipeline worker`, `pipeline agent-worker` (the real `openai` SDK inside its
agent) and `pipeline reward-worker`, with an episode run and a rewarded rollout run under way. Writes
are refused until each process has been refused many times; then every process is still alive,
each episode ends once, each row is rewarded once, and no process logged an error."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.compute as pc
import pytest

import pipeline
from pipeline.core.broker import reward_log
from pipeline.core.broker.connection import connect_redis
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.jobs import episodes
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, log_tail, stop_all, wait_healthy, wait_until
from tests.helpers.refusing_redis import allow_writes, refusals, refuse_writes

AGENT = "tests.helpers.agents:solve"
TASKS, TURNS = 9, 4  # three rounds of three: seconds of episodes still to run when writes are refused


REWARDS = "length=tests.helpers.reward_functions:length"


def test_every_process_waits_out_a_redis_that_refuses_writes(pipeline_env: dict[str, str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REWARDS", REWARDS)  # the submit checks the reward is known
    with RedisServer(tmp_path / "redis", port=free_port()) as redis_server:
        admin = redis_server.client()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**pipeline_env, "PIPELINE_REDIS_URL": redis_server.url, "PIPELINE_SERVE_URL": url,
               "PIPELINE_REWARDS": REWARDS}
        processes: dict[str, subprocess.Popen] = {}

        def start(name: str, *args: str) -> subprocess.Popen:
            processes[name] = subprocess.Popen([*PIPELINE, *args], env=env, stdout=(tmp_path / f"{name}.log").open("w"),
                                               stderr=subprocess.STDOUT)
            return processes[name]

        try:
            serve = start("serve", "serve", "--port", str(port), "--run", "episodes", "--turn-timeout", "120")
            wait_healthy(url, serve, tmp_path / "serve.log", timeout_s=120, what="pipeline serve")
            start("gpu", "worker", "--engine", "sim", "--sim-capacity", "4", "--sim-step-ms", "20",
                  "--sim-median-tokens", "8", "--sim-p99-tokens", "9", "--heartbeat-interval", "0.5",
                  "--log-level", "WARNING")
            conn = connect_redis(redis_server.url)
            client = pipeline.Client(conn)
            wait_until(lambda: len(client.workers()) == 1, 60, "the GPU worker")
            tasks = [{"id": f"t{i}", "prompt": [5 + i, 6, 7], "turns": TURNS, "turn_s": 0.3} for i in range(TASKS)]
            run = client.submit_episodes(tasks, agent=AGENT, run="episodes", n=1)
            requests = [{"id": f"r{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}
                        for i in range(40)]
            batch = client.submit(requests, run="rewarded", output=f"file://{tmp_path}/shards", batch_size=2,
                                  reward="length")
            start("agent", "agent-worker", "--agent", AGENT, "--concurrency", "3", "--log-level", "WARNING")
            start("reward", "reward-worker", "--batch-rows", "2", "--log-level", "WARNING")
            wait_until(lambda: run.counts()["finished"] >= 1 and len(reward_log.read_all(admin, "rewarded")) >= 1,
                       120, "episodes and rewards under way")
            before = refusals(admin)
            refuse_writes(admin)
            assert run.counts()["finished"] < TASKS  # refused with episodes still to run
            wait_until(lambda: refusals(admin) >= before + 40
                       or any(p.poll() is not None for p in processes.values()), 60, "forty refusals")
            assert {name: p.poll() for name, p in processes.items()} == dict.fromkeys(processes)
            allow_writes(admin)
            counts = run.wait(timeout=300)
            assert batch.wait(timeout=300).counts["finished"] == len(batch.job_ids)
            wait_until(lambda: len(reward_log.read_all(admin, "rewarded")) == len(batch.job_ids), 120,
                       "every shard rewarded")
            assert {name: p.poll() for name, p in processes.items()} == dict.fromkeys(processes)
        finally:
            allow_writes(admin)
            stop_all(list(processes.values()))
        assert counts["finished"] == TASKS and counts["failed"] == 0
        assert sorted(episodes.outcomes(admin, "episodes")) == sorted(f"t{i}:0" for i in range(TASKS))
        table = pipeline.read_rollouts(f"file://{tmp_path}/shards", "rewarded", rewards=True, conn=admin)
        assert sorted(pc.unique(table["request_id"]).to_pylist()) == sorted(r["id"] for r in requests)
        assert table.num_rows == len(requests) and table.column("reward").null_count == 0  # each row once, rewarded
        for name in processes:  # waited, not failed: nothing logged as an error
            log = tmp_path / f"{name}.log"
            assert " ERROR " not in log.read_text(), f"{name}:\n{log_tail(log)}"
