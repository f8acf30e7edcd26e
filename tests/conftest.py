"""Shared fixtures: a real redis-server process on a free loopback port, tiny models."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.redis_server import RedisServer
from tests.models import build_random_model, build_random_moe_model, build_scripted_model

# Scripted transitions shared by the contract tests: a→b→c→d, then d branches to e (→ EOS)
# or to the x/y loop; "!" loops forever; "h" says "hello world" then EOS.
SCRIPT = {
    "a": "b", "b": "c", "c": "d", "d": ["e", "x"], "e": "<eos>",
    "x": "y", "y": "x",
    "!": "!",
    "h": "e", "H": "i",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session (tests flush it through `redis_url`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), port=_free_port())
    server.ensure_started()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    client = redis_server.client()
    client.flushall()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random dense Llama (vocab 72, char tokenizer, EOS id 0)."""
    return build_random_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama that follows `SCRIPT` (see tests/models.py)."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPT)


@pytest.fixture
def pipeline_env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    """Environment for a `pipeline` subprocess pointed at the test Redis and a temp state dir."""
    env = dict(os.environ)
    env["PIPELINE_REDIS_URL"] = redis_url
    env["PIPELINE_HOME"] = str(tmp_path / "state")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return env


PIPELINE = [sys.executable, "-m", "pipeline.cli"]


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE: 2 layers, 8 experts, top-2, vocab 72, char tokenizer, EOS id 0."""
    return build_random_moe_model(tmp_path_factory.mktemp("tiny-moe"))
