"""compose.yaml, .env.example and docs/configuration.md hold together.

Checked structurally (no Docker engine here): the services a cluster needs, builds or
images, healthchecks, nothing published beyond loopback, every variable compose reads
documented in .env.example, every PIPELINE_* variable the code reads documented in
docs/configuration.md. `docker compose config` runs too where a compose client exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
LONG_RUNNING = ["redis", "minio", "sglang-0", "sglang-1", "gateway", "vllm-0", "dashboard"]
WORKERS = ["worker-0", "worker-1", "worker-gateway", "worker-cpu", "worker-vllm"]


def test_the_cluster_services_are_there() -> None:
    assert {"redis", "minio", "minio-init", "sglang-0", "gateway", "dashboard", *WORKERS} <= set(SERVICES)
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"
    for name in LONG_RUNNING:
        assert "healthcheck" in SERVICES[name], f"{name} has no healthcheck"
        assert SERVICES[name].get("restart") == "unless-stopped", f"{name} has no restart policy"


def test_redis_persists_and_needs_a_password() -> None:
    command = SERVICES["redis"]["command"]
    assert "--appendonly yes" in command and "--requirepass" in command
    assert "ports" not in SERVICES["redis"], "Redis must stay on the compose network"


def test_only_loopback_ports_are_published() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_workers_talk_to_their_own_sglang_server_and_shard_to_s3() -> None:
    for index in (0, 1):
        worker = SERVICES[f"worker-{index}"]
        command = worker["command"]
        assert command[:3] == ["worker", "--engine", "sglang-http"]
        assert command[command.index("--url") + 1] == f"http://sglang-{index}:30000"
        assert f"sglang-{index}" in worker["depends_on"]
    for name in WORKERS:
        env = SERVICES[name]["environment"]
        assert env["PIPELINE_REDIS_URL"].startswith("redis://:") and "@redis:6379" in env["PIPELINE_REDIS_URL"]
        assert "s3://" in env["PIPELINE_OUTPUT"] and env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert "PIPELINE_CONTROL_SECRET" in env and "PIPELINE_METRICS_PORT" in env
        assert "--metrics-host" in SERVICES[name]["command"]
    behind = SERVICES["worker-gateway"]["command"]
    assert behind[:3] == ["worker", "--engine", "sglang-http"] and behind[behind.index("--url") + 1] == "http://gateway:30000"
    gpu = SERVICES["sglang-0"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert SERVICES["worker-cpu"]["build"]["args"]["EXTRAS"] == "hf,s3"


def test_the_gateway_is_smg_in_front_of_both_servers_which_workers_behind_it_reach_too() -> None:
    gateway = SERVICES["gateway"]
    assert "smg==1.13.0" in gateway["build"]["dockerfile_inline"], "the gateway version the tests run against"
    command = gateway["command"]
    assert command[:1] == ["launch"]
    urls = command[command.index("--worker-urls") + 1:]
    assert urls == ["http://sglang-0:30000", "http://sglang-1:30000"]
    for name in ("sglang-0", "sglang-1"):
        assert set(SERVICES[name]["profiles"]) == {"gpu", "gateway"}, name
    assert SERVICES["gateway"]["profiles"] == SERVICES["worker-gateway"]["profiles"] == ["gateway"]
    assert SERVICES["worker-0"]["profiles"] == ["gpu"], "per-server workers stay out of the gateway layout"


def test_the_vllm_profile_serves_the_contract_and_its_worker_reaches_it() -> None:
    """The flags the vllm-http engine needs: dev endpoints (pause, reload, aborts) and the contract's
    logprobs (tests/helpers/vllm_server.py starts the test server the same way)."""
    from tests.helpers.vllm_server import SERVER_FLAGS

    server = SERVICES["vllm-0"]
    assert server["profiles"] == SERVICES["worker-vllm"]["profiles"] == ["vllm"]
    assert server["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert " ".join(SERVER_FLAGS) in server["command"] and "--port 8000" in server["command"]
    assert server["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert "ports" not in server, "the development endpoints must stay on the compose network"
    assert "/models:ro" in server["volumes"][0], "weight reloads read the paths the workers are pushed"
    worker = SERVICES["worker-vllm"]["command"]
    assert worker[:3] == ["worker", "--engine", "vllm-http"] and worker[worker.index("--url") + 1] == "http://vllm-0:8000"
    assert "vllm-0" in SERVICES["worker-vllm"]["depends_on"]


def test_every_compose_variable_is_in_env_example() -> None:
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", (ROOT / "compose.yaml").read_text()))
    documented = set(re.findall(r"^([A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    assert used - documented == set(), f"compose variables missing from .env.example: {sorted(used - documented)}"


def test_every_variable_the_code_reads_is_documented() -> None:
    sources = [p for package in ("schemas", "pipeline", "workers") for p in (ROOT / package).rglob("*.py")]
    read = set()
    for path in sources:
        read |= set(re.findall(r"\"(PIPELINE_[A-Z0-9_]+)\"", path.read_text()))
    doc = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"PIPELINE_[A-Z0-9_]+", doc))
    assert read, "no variables found: the scan is broken"
    assert read - documented == set(), f"undocumented variables: {sorted(read - documented)}"


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="no docker compose client on this machine",
)
def test_docker_compose_config(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text((ROOT / ".env.example").read_text())
    result = subprocess.run(["docker", "compose", "--env-file", str(env), "--profile", "gpu", "--profile", "cpu",
                             "--profile", "gateway", "--profile", "vllm", "config", "--quiet"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
