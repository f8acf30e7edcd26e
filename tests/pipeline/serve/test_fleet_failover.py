"""Episodes across a Redis master failover (Sentinel): the sessions carry on, each turn answered
once, nothing lost or duplicated (real redis-servers and sentinels, real worker processes, the
real server, the real `openai` SDK)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from pipeline.core.broker import keys
from pipeline.core.broker.connection import connect_redis
from pipeline.read.lineage_rows import turn_rows
from pipeline.serve.server import ServeConfig, Server
from tests.conftest import PIPELINE
from tests.helpers.processes import stop_all, wait_until
from tests.helpers.sentinel_group import SentinelGroup
from tests.helpers.session_calls import turn_ids_in_flight

SESSIONS, TURNS = 4, 6


def _episode(url: str, session: str, answers: list[Any], errors: list[BaseException]) -> None:
    client = openai.OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="unused", max_retries=8, timeout=120)
    prompt = list(range(1, 41))
    try:
        for _ in range(TURNS):
            answer = client.completions.create(model="m", prompt=prompt, max_tokens=64)
            answers.append(answer)
            prompt = prompt + answer.choices[0].token_ids + list(range(300, 320))
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_sessions_carry_on_across_a_redis_master_failover(pipeline_env: dict[str, str], tmp_path: Path) -> None:
    group = SentinelGroup(tmp_path / "sentinel", replicas=1, down_after_ms=500, failover_timeout_ms=1000)
    with group:
        env = {**pipeline_env, "PIPELINE_REDIS_URL": group.url}
        workers = [subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", "--heartbeat-interval", "0.5",
                                     "--sim-step-ms", "20", "--sim-median-tokens", "30", "--sim-p99-tokens", "31",
                                     "--log-level", "WARNING"], env=env,
                                    stdout=(tmp_path / f"w{i}.log").open("w"), stderr=subprocess.STDOUT)
                   for i in range(2)]
        conn = connect_redis(group.url, reconnect_for_s=30)
        server = Server(ServeConfig(port=0, redis_url=group.url, run="agents", output=f"file://{tmp_path}/shards",
                                    turn_timeout_s=60)).start()
        try:
            wait_until(lambda: len(conn.keys(keys.pool(None).worker("*"))) == 2, timeout=60, what="two workers")
            ids = [httpx.post(f"{server.url}/sessions", json={}, timeout=30).json()["session_id"]
                   for _ in range(SESSIONS)]
            answers: list[Any] = []
            errors: list[BaseException] = []
            threads = [threading.Thread(target=_episode, args=(server.url, sid, answers, errors)) for sid in ids]
            for thread in threads:
                thread.start()
            # Kill the master once every session is in the middle of its episode.
            wait_until(lambda: int(conn.hget(keys.run_turn_stats("agents"), "turns") or 0) >= SESSIONS * 2,
                       timeout=120, what="two turns of each session")
            in_flight = sum(bool(turn_ids_in_flight(conn, sid)) for sid in ids)
            old = group.kill_master()
            for thread in threads:
                thread.join(timeout=300)
            assert in_flight >= 1  # the master died with turns in flight
            assert errors == [], errors
            assert len(answers) == SESSIONS * TURNS
            group.wait_for_failover(old)
            rows = turn_rows("agents", connect_redis(group.url, reconnect_for_s=30)).to_pylist()
            served = sorted((r["session_id"], r["turn"]) for r in rows)
            assert served == sorted((sid, t) for sid in ids for t in range(TURNS))  # each turn once
        finally:
            server.stop()
            stop_all(workers)
