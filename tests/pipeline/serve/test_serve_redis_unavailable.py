"""`pipeline serve` with its Redis unavailable (real redis-server, real `pipeline serve` and
`pipeline worker` processes): a Redis that refuses writes for a while (`NOREPLICAS`) is waited out,
and the call is answered once, when writes come back; a Redis that is down makes `GET /health`
answer 503 at once, not after the minute its commands retry for."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from pipeline.core.broker.redis_server import RedisServer
from pipeline.read.lineage_rows import turn_rows
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, log_tail, stop_all, wait_healthy, wait_until
from tests.helpers.refusing_redis import allow_writes, refusals, refuse_writes

SIM = ["--engine", "sim", "--sim-step-ms", "5", "--sim-median-tokens", "8", "--sim-p99-tokens", "9",
       "--heartbeat-interval", "0.5", "--log-level", "WARNING"]


def _serve(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    port, log = free_port(), tmp_path / "serve.log"
    server = subprocess.Popen([*PIPELINE, "serve", "--port", str(port), "--run", "chat",
                               "--output", f"file://{tmp_path}/shards"], env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, server, log, timeout_s=120, what="pipeline serve")
    return server, url, log


def test_a_call_waits_out_a_redis_that_refuses_writes(tmp_path: Path, pipeline_env: dict[str, str]) -> None:
    with RedisServer(tmp_path / "redis", port=free_port()) as redis_server:
        admin = redis_server.client()
        env = {**pipeline_env, "PIPELINE_REDIS_URL": redis_server.url}
        worker = subprocess.Popen([*PIPELINE, "worker", *SIM], env=env, stdout=(tmp_path / "worker.log").open("w"),
                                  stderr=subprocess.STDOUT)
        server, url, log = _serve(env, tmp_path)
        try:
            wait_until(lambda: httpx.get(f"{url}/health", timeout=10).json().get("live_workers") == 1, 60,
                       "the worker to be live")
            sid = httpx.post(f"{url}/sessions", json={}, timeout=30).json()["session_id"]
            client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=0, timeout=120)
            before = refusals(admin)
            refuse_writes(admin)
            answers: list[Any] = []
            call = threading.Thread(target=lambda: answers.append(
                client.completions.create(model="m", prompt=list(range(1, 21)), max_tokens=8)))
            call.start()
            wait_until(lambda: refusals(admin) >= before + 10 or not call.is_alive(), 60, "ten refusals")
            assert call.is_alive(), answers  # still waiting (it used to answer 500 at the first refusal)
            allow_writes(admin)
            call.join(timeout=120)
            assert len(answers) == 1 and answers[0].choices[0].token_ids
            assert server.poll() is None and worker.poll() is None, log_tail(log)
            rows = turn_rows("chat", admin).to_pylist()
            assert [(r["session_id"], r["turn"]) for r in rows] == [(sid, 0)]  # answered once
        finally:
            allow_writes(admin)
            stop_all([server, worker])


def test_health_answers_503_at_once_when_redis_is_down(tmp_path: Path, pipeline_env: dict[str, str]) -> None:
    redis_server = RedisServer(tmp_path / "redis", port=free_port())
    redis_server.ensure_started()
    server, url, log = _serve({**pipeline_env, "PIPELINE_REDIS_URL": redis_server.url}, tmp_path)
    try:
        redis_server.stop()
        # Its commands retry for PIPELINE_REDIS_RECONNECT_S (a minute): the probe does not.
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "unhealthy"
        assert server.poll() is None, log_tail(log)
    finally:
        stop_all([server])
        redis_server.stop()
