"""Fixtures for agent episodes: a real Redis, a real `pipeline serve` (uvicorn on a free port, no
tokenizer: the test agents send token ids), a rollout worker around a fake engine in the test's main
thread, and an agent worker in another (`run_episodes`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.core import agents
from pipeline.serve.server import ServeConfig, Server, build_turns
from tests.helpers.agents import EVENTS_VAR
from tests.helpers.processes import drive_worker
from workers.agents.worker import AgentWorker, WorkerStats
from workers.engines.fake import FakeEngine

AGENTS = "tests.helpers.agents"


@pytest.fixture
def server(redis_client: redis.Redis, tmp_path: Path) -> Iterator[Server]:
    config = ServeConfig(port=0, run="agents-default", output=f"file://{tmp_path}/shards", turn_timeout_s=30.0)
    server = Server(config, build_turns(config, redis_client)).start()
    yield server
    server.stop()


@pytest.fixture
def events_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "agent-events.jsonl"
    monkeypatch.setenv(EVENTS_VAR, str(path))
    return path


def agent(name: str) -> str:
    return f"{AGENTS}:{name}"


def run_episodes(conn: redis.Redis, server: Server, *names: str, engine: Any = None, concurrency: int = 4,
                 **options: Any) -> WorkerStats:
    """Run the queued episodes of the named test agents to the end (a burst agent worker in a thread,
    the rollout worker serving their turns in this one); the agent worker's stats."""
    worker = AgentWorker(conn, {agent(n): agents.load(agent(n)) for n in names}, serve_url=server.url,
                         concurrency=concurrency, **options)
    done: dict[str, WorkerStats] = {}
    drive_worker(conn, engine or FakeEngine(), lambda: done.update(stats=worker.work(burst=True)),
                 stop_when_done=True)
    return done["stats"]
