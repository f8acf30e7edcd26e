"""deploy/k8s: every overlay renders with `kubectl kustomize` and validates strictly against the
Kubernetes API schemas (`kubernetes-validate --strict`); what the manifests promise holds in what
they render (probes, GPUs, grace periods, Secrets, Redis's settings, disruption budgets); every
`pipeline` command line in them parses with the CLI's own parser; a missing key file is an error
at start.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli.main import build_parser
from tests.conftest import PIPELINE

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
SECRET = "pipeline-secrets"
# Validated against the oldest release with native sidecars on by default (the engine is one) and
# the newest the package knows.
VERSIONS = ["1.29.0", None]

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on this machine")


def _render(overlay: str) -> str:
    result = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, str, list[dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl on this machine")
    text = _render(request.param)
    return request.param, text, [doc for doc in yaml.safe_load_all(text) if doc]


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"}]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """The long-lived containers: the main ones and the native sidecars (init containers that stay)."""
    spec = workload["spec"]["template"]["spec"]
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return spec["containers"] + sidecars


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_there_is_one_overlay_per_layout() -> None:
    assert OVERLAYS == ["fleet", "single-gpu"]


@needs_kubectl
@pytest.mark.parametrize("version", VERSIONS)
def test_every_overlay_validates_strictly(overlay: tuple[str, str, list[dict[str, Any]]], version: str | None,
                                          tmp_path: Path) -> None:
    name, text, _ = overlay
    rendered = tmp_path / f"{name}.yaml"
    rendered.write_text(text)
    validate = Path(sys.executable).parent / "kubernetes-validate"
    command = [str(validate), "--strict", "--quiet", *(["-k", version] if version else []), str(rendered)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_long_lived_container_has_probes_and_resource_requests(overlay) -> None:  # type: ignore[no-untyped-def]
    _, _, docs = overlay
    workloads = _workloads(docs)
    assert {w["metadata"]["name"] for w in workloads} == {
        "redis", "sentinel", "worker", "serve", "agent-worker", "reward-worker"}
    for workload in workloads:
        for container in _containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert "readinessProbe" in container and "livenessProbe" in container, f"{where}: a probe is missing"
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), f"{where}: no cpu/memory request"


def test_gpu_workers_take_a_gpu_each_and_hand_their_batch_back_on_the_way_out(overlay) -> None:  # type: ignore[no-untyped-def]
    _, _, docs = overlay
    pod = _named(docs, "Deployment", "worker")["spec"]["template"]["spec"]
    engine = next(c for c in pod["initContainers"] if c["name"] == "engine")
    assert engine["restartPolicy"] == "Always", "the engine must outlive the worker's last batch (a native sidecar)"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    assert worker["args"][worker["args"].index("--url") + 1] == "http://127.0.0.1:30000"
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= 60
    # preStop: the first SIGTERM (finish the batch), then the kubelet's, the second (hand it back),
    # early enough before SIGKILL for the hand-back to reach Redis.
    stop = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert "kill -TERM 1" in stop
    wait = int(re.search(r"sleep (\d+)", stop).group(1))  # type: ignore[union-attr]
    assert 0 < wait <= grace - 20


def test_secrets_come_from_the_one_secret_which_no_overlay_ships(overlay) -> None:  # type: ignore[no-untyped-def]
    """The operator creates `pipeline-secrets`; without it (or a key of it) the kubelet refuses to start
    the container, naming the Secret and key (CreateContainerConfigError), instead of a crash loop."""
    _, _, docs = overlay
    assert not [d for d in docs if d["kind"] == "Secret"], "keys must not live in the repository"
    keys: dict[str, set[str]] = {}
    for workload in _workloads(docs):
        for container in _containers(workload):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == SECRET and not ref.get("optional", False), env["name"]
                    keys.setdefault(container["name"], set()).add(ref["key"])
    assert "control-secret" in keys["worker"] and "serve-api-key" in keys["serve"]
    assert keys["redis"] == keys["sentinel"] == {"redis-password"}
    documented = (ROOT / "docs" / "deployment.md").read_text()
    for key in set().union(*keys.values()):
        assert f"--from-literal={key}=" in documented, f"docs/deployment.md does not create the key {key}"


def test_redis_runs_under_three_sentinels_with_aof_and_min_replicas(overlay) -> None:  # type: ignore[no-untyped-def]
    _, _, docs = overlay
    redis = _named(docs, "StatefulSet", "redis")
    sentinel = _named(docs, "StatefulSet", "sentinel")
    assert redis["spec"]["replicas"] >= 2 and sentinel["spec"]["replicas"] >= 3
    for workload in (redis, sentinel):
        assert workload["spec"]["template"]["spec"]["containers"][0]["image"].startswith("redis:")
    script = _named(docs, "ConfigMap", "redis-scripts")["data"]["redis.sh"]
    # docs/durability.md's choice (everysec) and docs/failover.md's (with two replicas, 1 within 10 s).
    for setting in ("--appendonly yes", "--appendfsync everysec", "--min-replicas-to-write 1",
                    "--min-replicas-max-lag 10"):
        assert setting in script, setting
    assert redis["spec"]["replicas"] >= 3, "min-replicas-to-write 1 needs two replicas (docs/failover.md)"
    for name, text in _named(docs, "ConfigMap", "redis-scripts")["data"].items():
        result = subprocess.run(["sh", "-n"], input=text, capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    urls = {env["value"] for w in _workloads(docs) for c in _containers(w) for env in c.get("env", [])
            if env["name"] == "PIPELINE_REDIS_URL"}
    assert urls == {"redis+sentinel://:$(REDIS_PASSWORD)@sentinel-0.sentinel:26379,sentinel-1.sentinel:26379,"
                    "sentinel-2.sentinel:26379/pipeline/0"}


def test_every_workload_has_a_disruption_budget_and_serve_a_service(overlay) -> None:  # type: ignore[no-untyped-def]
    _, _, docs = overlay
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets == {w["metadata"]["name"] for w in _workloads(docs)}
    service = _named(docs, "Service", "serve")
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "serve"}
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {"rollouts"}


def test_every_pipeline_command_line_parses(overlay) -> None:  # type: ignore[no-untyped-def]
    """Each `pipeline` container's arguments, $(VAR) references filled in, parse with the command's own
    parser: an unknown command, option or choice fails here, not in a crash loop."""
    _, _, docs = overlay
    seen = set()
    for workload in _workloads(docs):
        for container in _containers(workload):
            if container.get("command") != ["pipeline"]:
                continue
            args = [re.sub(r"\$\(([A-Z_]+)\)", "1", a) for a in container["args"]]
            try:
                build_parser(only=args[0]).parse_args(args)
            except SystemExit:
                pytest.fail(f"{workload['metadata']['name']}: `pipeline {' '.join(container['args'])}` does not parse")
            seen.add(args[0])
    assert seen == {"worker", "serve", "agent-worker", "reward-worker"}


def test_a_control_key_file_that_is_not_there_is_an_error_at_start(tmp_path: Path) -> None:
    """A key mounted from a Secret as a file (PIPELINE_CONTROL_SECRET_FILE) that is missing or empty stops
    every command at once, naming the variable and the file, before it touches Redis or an engine."""
    empty = tmp_path / "empty"
    empty.write_text("")
    for path, says in ((tmp_path / "absent", "cannot be read"), (empty, "is empty")):
        env = {**os.environ, "PIPELINE_CONTROL_SECRET_FILE": str(path), "PYTHONPATH": str(ROOT)}
        env.pop("PIPELINE_CONTROL_SECRET", None)
        result = subprocess.run([*PIPELINE, "worker", "--engine", "sim", "--burst", "--redis", "redis://127.0.0.1:1/0"],
                                env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: $PIPELINE_CONTROL_SECRET_FILE names ") and says in result.stderr
        assert str(path) in result.stderr and "Traceback" not in result.stderr
