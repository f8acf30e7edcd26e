"""A verifiers environment runs as an agent with no glue (`--agent workers.agents.verifiers_env:ENV_ID`):
its harness makes the turns through the episode's session, its rubric gives the reward, and the
episode is one exact trajectory (verifiers 0.4.0, the `vf_calc_env` environment of the serve tests)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis

import pipeline
from pipeline.core import agents
from pipeline.serve.server import ServeConfig, Server, build_turns
from tests.helpers.processes import drive_worker
from tests.pipeline.serve.conftest import TOKENIZER, Script
from workers.agents.worker import AgentWorker

SERVE_TESTS = Path(__file__).resolve().parents[2] / "pipeline" / "serve"
CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 2, "b": 3}}</tool_call>'
AGENT = "workers.agents.verifiers_env:vf_calc_env"


@pytest.fixture(autouse=True)
def _offline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(SERVE_TESTS))  # the environment, here and in verifiers' subprocesses
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SERVE_TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # anything off this machine fails
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def test_a_verifiers_environment_is_an_agent_with_no_glue(redis_client: redis.Redis, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    script = Script(AutoTokenizer.from_pretrained(str(TOKENIZER)), {0: f"I will add.{CALL}", 1: "The answer is 5."})
    config = ServeConfig(port=0, tokenizer=str(TOKENIZER), tool_call_parser="hermes", run="vf",
                         output=f"file://{tmp_path}/shards", turn_timeout_s=60.0)
    server = Server(config, build_turns(config, redis_client)).start()
    try:
        run = pipeline.Client(redis_client).submit_episodes([{"id": "add", "sampling": {"temperature": 0.0}}],
                                                            agent=AGENT, run="vf", n=2)
        worker = AgentWorker(redis_client, {AGENT: agents.load(AGENT)}, serve_url=server.url)
        drive_worker(redis_client, script.engine(), lambda: worker.work(burst=True), stop_when_done=True)
    finally:
        server.stop()
    outcomes: dict[str, Any] = run.outcomes()
    assert {k: (o.status, o.reward, o.turns) for k, o in outcomes.items()} == {
        "add:0": ("finished", 1.0, 2), "add:1": ("finished", 1.0, 2)}, {k: o.reason for k, o in outcomes.items()}
    (group,) = run.groups()
    for item in group.to_pylist():
        assert item["turns"] == [0, 1] and item["lineages"] == 1 and item["reward"] == 1.0
        text = script.tokenizer.decode(item["input_ids"], skip_special_tokens=False)
        assert '"name": "calc_add"' in text and "<|tool|>5<|end|>" in text and text.endswith("The answer is 5.<|end|>")
