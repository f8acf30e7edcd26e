"""The README's agent (the `openai` SDK against `pipeline serve`) runs as written, and its
trajectory is read back for training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from tests.pipeline.serve.conftest import Script, run_agent

README = Path(__file__).resolve().parents[3] / "README.md"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_the_readme_agent_runs_against_pipeline_serve(redis_client: redis.Redis, redis_url: str, serve: Any,
                                                      tools_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = README.read_text()
    start = readme.index("```python\nimport httpx, json, openai, pipeline\n")
    example = readme[start + len("```python\n"): readme.index("```", start + 3)]
    stack = serve()  # run "agents", as the README's `pipeline serve --run agents`
    example = example.replace("http://127.0.0.1:8000", stack.url)
    monkeypatch.setenv("PIPELINE_REDIS_URL", redis_url)  # `read_trajectories("agents")` reads this Redis
    scope: dict[str, Any] = {}
    script = Script(tools_tokenizer, {0: CALL, 1: "5"})
    run_agent(redis_client, script.engine(), lambda: exec(compile(example, "README.md", "exec"), scope))
    assert scope["message"].content == "5" and scope["messages"][2] == {
        "role": "tool", "tool_call_id": scope["messages"][1]["tool_calls"][0]["id"], "content": "5"}
    (episode,) = scope["batch"].to_pylist()
    assert episode["reward"] == 1.0 and sum(episode["loss_mask"]) == sum(
        len(tools_tokenizer.encode(text, add_special_tokens=False)) + 1 for text in (CALL, "5"))
