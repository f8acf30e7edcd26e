"""verifiers 0.4.0 evaluates a multi-turn tool environment (`vf_calc_env`) against `pipeline serve`.

verifiers relays its chat program's calls to the server with `X-Session-ID: <trace id>` on every
call (the server opens that session at its first call) and always streams with usage; its MCP
tool runs in a subprocess. The rollout reaches the rewarded answer, and the trace's session is one
exact trajectory of both turns, with no prefix break. Nothing leaves this machine: the runtime is
`subprocess` (verifiers' default is a remote `prime` sandbox), the API key variable is not
`PRIME_API_KEY` (no `~/.prime` lookup), and any outbound HTTP would hit a dead proxy.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.core.broker import keys
from tests.pipeline.serve.conftest import Script, exact_trajectory, run_agent

HERE = Path(__file__).resolve().parent
CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>'
KEY_VAR = "PIPELINE_TEST_VF_API_KEY"


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The env module, importable here and in verifiers' subprocesses (`python -m vf_calc_env`).
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv(KEY_VAR, raising=False)  # unset: verifiers sends "EMPTY"
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # a closed port: anything off this machine fails
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def test_a_verifiers_tool_environment_is_rewarded_and_exact(redis_client: redis.Redis, serve: Any,
                                                           tools_tokenizer: Any) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    script = Script(tools_tokenizer, {0: f"I will add.{CALL}", 1: "The answer is 5."})
    stack = serve()
    got: dict[str, Any] = {}

    async def evaluate() -> list[Any]:
        config = resolve_env_config({"taskset": {"id": "vf_calc_env"}, "agent": {"runtime": {"type": "subprocess"}}})
        env = load_environment(config)
        ctx = vf.ModelContext(model="tiny-tools",
                              client=vf.EvalClientConfig(base_url=f"{stack.url}/v1", api_key_var=KEY_VAR),
                              sampling=vf.SamplingConfig(temperature=0.0))
        async with env.serving():
            return [await env.run_slot(slot, ctx) for task in env.taskset for slot in env.slots(task, 1)]

    def agent() -> None:
        got["episodes"] = asyncio.run(evaluate())

    run_agent(redis_client, script.engine(), agent)
    (episode,) = got["episodes"]
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.last_reply == "The answer is 5."
    assert trace.reward == 1.0 and trace.rewards["correct"] is not None

    # The trace id named the session; its two turns were scripted by the session's turn index.
    sid = trace.id
    assert [request.id for request in script.seen] == [f"{sid}:0", f"{sid}:1"]
    session = redis_client.hgetall(keys.session(sid))
    assert session[b"turns"] == b"2" and b"prefix_breaks" not in session
    item = exact_trajectory(redis_client, stack.run, sid, 2)
    text = tools_tokenizer.decode(item["input_ids"], skip_special_tokens=False)
    assert '"name": "calc_add"' in text and "<|tool|>5<|end|>" in text and text.endswith("The answer is 5.<|end|>")
