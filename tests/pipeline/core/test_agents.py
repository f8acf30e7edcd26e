"""Naming an agent: found on the path or in the current directory, as uvicorn finds `main:app`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.core import agents


def test_an_agent_in_the_current_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_cwd_agents.py").write_text("async def solve(task, client, episode):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_agents", raising=False)
    solve = agents.load("my_cwd_agents:solve")
    assert agents.is_async(solve) and solve.__module__ == "my_cwd_agents"
