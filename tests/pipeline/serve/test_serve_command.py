"""`pipeline serve` as a user runs it: real processes (the server, a `pipeline worker` on the demo
model), real text from a real model through the `openai` SDK, the trajectory read back exact."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import redis

import pipeline
from pipeline.read.lineage_rows import turn_rows
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port


def _wait_healthy(url: str, process: subprocess.Popen, workers: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "pipeline serve exited"
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("live_workers", 0) >= workers:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a process that exposes no event to wait on
    raise AssertionError("pipeline serve or its worker did not come up")


def test_binding_beyond_loopback_needs_an_api_key(pipeline_env: dict[str, str]) -> None:
    done = subprocess.run([*PIPELINE, "serve", "--host", "0.0.0.0", "--port", "0"], env=pipeline_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--api-key" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([*PIPELINE, "serve", "--tool-call-parser", "nope"], env=pipeline_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "qwen25" in done.stderr


def test_an_agent_talks_to_the_demo_model_through_pipeline_serve(
    pipeline_env: dict[str, str], redis_client: redis.Redis, demo_model_dir: Path, tmp_path: Path,
    start_worker: Callable[..., subprocess.Popen],
) -> None:
    port = free_port()
    server = subprocess.Popen(
        [*PIPELINE, "serve", "--port", str(port), "--tokenizer", str(demo_model_dir), "--run", "chat",
         "--output", f"file://{tmp_path}/shards"],
        env=pipeline_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        start_worker("--model", str(demo_model_dir))
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server, workers=1)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == demo_model_dir.name
        sid = httpx.post(f"{url}/sessions", json={"metadata": {"topic": "capitals"}}).json()["session_id"]
        client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        first = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12,
                                               logprobs=True)
        assert "Paris" in first.choices[0].message.content
        assert all(t.logprob <= 0 for t in first.choices[0].logprobs.content)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And of Italy?"}]
        second = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
        assert "Rome" in second.choices[0].message.content
    finally:
        server.terminate()
        server.wait(timeout=30)
    rows = sorted(turn_rows("chat", redis_client).to_pylist(), key=lambda r: r["turn"])
    assert [(r["turn"], r["prefix_break"]) for r in rows] == [(0, False), (1, False)]
    head = rows[0]["prompt_token_ids"] + rows[0]["completion_token_ids"]
    assert rows[1]["prompt_token_ids"][: len(head)] == head  # turn 0's sampled ids, verbatim, in turn 1's prompt
    (item,) = pipeline.read_trajectories("chat", conn=redis_client).to_pylist()
    assert sum(item["loss_mask"]) == sum(len(r["completion_token_ids"]) for r in rows)


def test_serve_help_names_every_parser_it_accepts() -> None:
    from pipeline.serve.parsers.reasoning import REASONING_PARSERS
    from pipeline.serve.parsers.tool_calls import TOOL_CALL_PARSERS

    shown = subprocess.run([*PIPELINE, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    flat = " ".join(shown.split())
    for name in (*TOOL_CALL_PARSERS, *REASONING_PARSERS):
        assert f" {name}," in flat or f" {name} " in flat or f"{name})" in flat, name
