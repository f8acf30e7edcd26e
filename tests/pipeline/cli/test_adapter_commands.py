"""`pipeline weights push --adapter NAME DIR` and `pipeline weights status` on the command line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import PIPELINE
from tests.helpers.adapters import build_adapter


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PIPELINE, *args], env=env, capture_output=True, text=True, timeout=120)


def test_weights_push_adapter_and_status(pipeline_env: dict[str, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = build_adapter(tiny_model_dir, tmp_path / "sql", seed=1)
    pushed = _cli(pipeline_env, "weights", "push", "--adapter", "sql", str(adapter), "--base", str(tiny_model_dir))
    assert pushed.returncode == 0, pushed.stderr
    assert f"pool default: adapter sql v1 from {adapter}" in pushed.stdout and ": current" in pushed.stdout
    status = _cli(pipeline_env, "weights", "status")
    assert "adapters: 1" in status.stdout and "sql  v1  rank 4 on q_proj, v_proj" in status.stdout

    with_version = _cli(pipeline_env, "weights", "push", "--adapter", "sql", str(adapter), "--version", "3")
    assert with_version.returncode == 2 and "--version: options of base weight pushes, not of --adapter" in \
        with_version.stderr
    not_peft = _cli(pipeline_env, "weights", "push", "--adapter", "sql", str(tmp_path), "--base", str(tiny_model_dir))
    assert not_peft.returncode == 2 and "not a PEFT adapter directory" in not_peft.stderr
    no_version = _cli(pipeline_env, "weights", "push", str(tiny_model_dir))
    assert no_version.returncode == 2 and "needs --version N" in no_version.stderr
    kept = [_cli(pipeline_env, "weights", "push", "--adapter", "sql", str(adapter), "--base", str(tiny_model_dir),
                 "--keep-versions", "1") for _ in range(2)]
    assert "adapter sql v2 from" in kept[0].stdout and ": current; pruned v1" in kept[0].stdout, kept[0].stderr
    assert ": current; pruned v2" in kept[1].stdout
    base_keep = _cli(pipeline_env, "weights", "push", str(tiny_model_dir), "--version", "1", "--keep-versions", "2")
    assert base_keep.returncode == 2 and "--keep-versions is an option of --adapter pushes" in base_keep.stderr
    # A partial adapter push (no worker here: nothing to continue) names its mode in the pool's state.
    partial = _cli(pipeline_env, "weights", "push", "--adapter", "sql", str(adapter), "--base", str(tiny_model_dir),
                   "--mode", "partial")
    assert partial.returncode == 0 and "adapter sql v4 from" in partial.stdout, partial.stderr
    status = json.loads(_cli(pipeline_env, "weights", "status", "--json").stdout)
    assert [(a["name"], a["version"], a["swap_mode"]) for a in status["adapters"]] == [("sql", 4, "partial")]
    assert "sql  v4  rank 4 on q_proj, v_proj  " in _cli(pipeline_env, "weights", "status").stdout
    assert "MB, partial  acknowledged by 0 worker(s)" in _cli(pipeline_env, "weights", "status").stdout
    drained = _cli(pipeline_env, "weights", "push", "--adapter", "sql", str(adapter), "--base", str(tiny_model_dir))
    assert drained.returncode == 0, drained.stderr
    status = json.loads(_cli(pipeline_env, "weights", "status", "--json").stdout)
    assert [(a["name"], a["version"], a["swap_mode"]) for a in status["adapters"]] == [("sql", 5, "drain")]
