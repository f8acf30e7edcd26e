"""A worker killed in the middle of a streamed turn (real worker processes, the real server, the
`openai` SDK): the client never gets a token twice and the turn is recorded once.

The victim's hf engine holds every sample after `HELD` tokens (`held_hf_worker`), so the kill
always lands mid-stream. With a checkpoint of those tokens, the next worker resumes the turn from
it and the client's stream goes on where it was; without one, the turn runs again from its prompt,
the stream ends with a `stream_diverged` error, and the client's retry of the call gets the
recorded answer.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import openai
import redis

from pipeline.core.broker import keys
from pipeline.read.lineage_rows import turn_rows
from tests.helpers.processes import wait_until
from tests.workers.jobs.test_checkpoint_workers import FAST, HELD, HELD_WORKER, kill, saved, tokens

LENGTH = 64
CALL: dict[str, Any] = {"model": "m", "prompt": list(range(5, 21)), "max_tokens": LENGTH,
                        "extra_body": {"ignore_eos": True}}


def _stream(url: str, session_id: str, got: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{url}/sessions/{session_id}/v1", api_key="x", max_retries=0, timeout=300)
    got["text"] = ""
    try:
        for chunk in client.completions.create(stream=True, **CALL):
            got["text"] += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                got["token_ids"] = chunk.choices[0].model_extra["token_ids"]
    except openai.APIError as exc:
        got["error"] = exc


def _held_checkpoint(conn: redis.Redis) -> list[np.ndarray] | None:
    for key in conn.scan_iter(keys.checkpoint("*")):
        chains = saved(conn, key.decode().rsplit(":", 1)[1])
        if chains and all(len(tokens(c)) == HELD for c in chains.values()):
            return [tokens(c) for c in chains.values()]
    return None


def _start(serve: Any, tiny_model_dir: Path, start_worker: Callable[..., subprocess.Popen], checkpoint_every: str,
           got: dict[str, Any]) -> tuple[Any, str, subprocess.Popen, threading.Thread]:
    stack = serve(tokenizer=str(tiny_model_dir), tool_call_parser=None, turn_timeout_s=300)
    victim = start_worker("--checkpoint-every", checkpoint_every, *FAST, **HELD_WORKER)
    sid = stack.session()
    client = threading.Thread(target=_stream, args=(stack.url, sid, got))
    client.start()
    wait_until(lambda: len(got.get("text", "")) > 0, 300, "the first streamed text")
    return stack, sid, victim, client


def test_a_stream_goes_on_from_the_checkpoint_of_a_killed_worker(
        redis_client: redis.Redis, serve: Any, tiny_model_dir: Path,
        start_worker: Callable[..., subprocess.Popen]) -> None:
    got: dict[str, Any] = {}
    stack, sid, victim, client = _start(serve, tiny_model_dir, start_worker, "0.2", got)
    wait_until(lambda: _held_checkpoint(redis_client) is not None, 300, "a checkpoint of the held sample")
    (kept,) = _held_checkpoint(redis_client)  # type: ignore[misc]
    kill(victim)
    sent_before = got["text"]
    start_worker("--checkpoint-every", "0.2", *FAST)
    client.join(300)
    assert "error" not in got, got.get("error")
    (row,) = turn_rows(stack.run, redis_client).to_pylist()
    assert got["token_ids"] == row["completion_token_ids"] and len(row["completion_token_ids"]) == LENGTH
    assert row["completion_token_ids"][:HELD] == kept.tolist()  # the dead worker's tokens, kept
    assert got["text"].startswith(sent_before)
    answer = openai.OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0).completions \
        .create(**CALL, extra_headers={"x-stainless-retry-count": "1"})  # the SDK's retry: the recorded answer
    assert got["text"] == answer.choices[0].text  # every token once, in order


def test_a_stream_that_cannot_go_on_ends_with_an_error_and_the_retry_gets_the_recorded_turn(
        redis_client: redis.Redis, serve: Any, tiny_model_dir: Path,
        start_worker: Callable[..., subprocess.Popen]) -> None:
    got: dict[str, Any] = {}
    stack, sid, victim, client = _start(serve, tiny_model_dir, start_worker, "3600", got)
    # Enough of the held tokens sent that the run again cannot repeat them by chance (a token or two
    # of this tiny model's small vocabulary it can, as happened on a loaded machine).
    wait_until(lambda: len(got.get("text", "")) >= HELD // 2, 300, "half the held tokens streamed")
    kill(victim)
    start_worker("--checkpoint-every", "3600", *FAST)
    client.join(300)
    assert isinstance(got.get("error"), openai.APIError), got
    assert "generated different ones" in str(got["error"]) and "token_ids" not in got
    retry = openai.OpenAI(base_url=f"{stack.url}/sessions/{sid}/v1", api_key="x", max_retries=0,
                          timeout=300).completions.create(**CALL, extra_headers={"x-stainless-retry-count": "1"})
    (row,) = turn_rows(stack.run, redis_client).to_pylist()  # recorded once
    assert retry.choices[0].model_extra["token_ids"] == row["completion_token_ids"]
