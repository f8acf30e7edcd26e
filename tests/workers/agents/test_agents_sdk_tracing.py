"""`pipeline agent-worker` turns the OpenAI Agents SDK's trace export off before it imports an agent
(the SDK would send every rollout's trace to api.openai.com, retrying for seconds where there is no
route), unless the environment says otherwise."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PIPELINE


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("0", "0")])
def test_the_agent_worker_turns_the_agents_sdk_tracing_off_unless_told(
        given: str | None, seen: str, pipeline_env: dict[str, str], tmp_path: Path) -> None:
    record = tmp_path / "tracing"
    env = {**pipeline_env, "PIPELINE_TEST_TRACING_FILE": str(record)}
    env.pop("OPENAI_AGENTS_DISABLE_TRACING", None)
    if given is not None:
        env["OPENAI_AGENTS_DISABLE_TRACING"] = given
    done = subprocess.run([*PIPELINE, "agent-worker", "--agent", "tests.helpers.tracing_agent:solve", "--burst",
                           "--serve", "http://127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert record.read_text() == seen
