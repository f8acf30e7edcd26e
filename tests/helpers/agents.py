"""Agents the episode tests run (`pipeline submit --agent tests.helpers.agents:NAME`), each a small
real agent: it talks to `pipeline serve` through the OpenAI client it is given, with token-id
prompts (`/v1/completions`), so no tokenizer is needed.

A task is `{"id": ..., "prompt": [token ids], "turns": N, "answer": X}`; after each turn the agent
appends the completion and a "tool result" (fixed ids) and calls again; its reward is 1.0 when the
sample index's parity matches `answer` (so a task's group has rewards that differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

TOOL_RESULT = [300, 301, 302]
EVENTS_VAR = "PIPELINE_TEST_AGENT_EVENTS"  # a file the agents append what happened to (any process)


def _event(**what: Any) -> None:
    path = os.environ.get(EVENTS_VAR)
    if path:
        with Path(path).open("a") as handle:
            handle.write(json.dumps(what) + "\n")


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _turns(task: dict[str, Any], client: Any, episode: Any, turns: int | None = None) -> list[int]:
    prompt = list(task.get("prompt", [1, 2, 3]))
    for _ in range(task.get("turns", 2) if turns is None else turns):
        answer = await client.completions.create(model="m", prompt=prompt, max_tokens=task.get("max_tokens", 4))
        prompt = prompt + answer.choices[0].token_ids + TOOL_RESULT
        if task.get("turn_s"):
            await asyncio.sleep(task["turn_s"])
    return prompt


async def solve(task: dict[str, Any], client: Any, episode: Any) -> dict[str, Any]:
    _event(kind="start", episode=episode.episode_id, attempt=episode.attempt, session=episode.session_id,
           pid=os.getpid())
    prompt = await _turns(task, client, episode)
    reward = 1.0 if episode.sample % 2 == task.get("answer", 0) else 0.0
    _event(kind="end", episode=episode.episode_id, attempt=episode.attempt, session=episode.session_id)
    return {"reward": reward, "tokens": len(prompt)}


async def flaky(task: dict[str, Any], client: Any, episode: Any) -> float:
    """Raises in its first attempt after one turn; succeeds in the next."""
    await _turns(task, client, episode, turns=1)
    if episode.attempt == 1:
        raise ConnectionResetError("the tool's sandbox went away")
    await _turns(task, client, episode)
    return 1.0


async def hangs(task: dict[str, Any], client: Any, episode: Any) -> float:
    await _turns(task, client, episode, turns=1)
    await asyncio.sleep(3600)
    return 1.0


async def bad_reward(task: dict[str, Any], client: Any, episode: Any) -> Any:
    await _turns(task, client, episode, turns=1)
    return "five"


async def silent(task: dict[str, Any], client: Any, episode: Any) -> float:
    return 1.0


async def rejects(task: dict[str, Any], client: Any, episode: Any) -> float:
    if "question" not in task:
        raise KeyError(f"task {task.get('id')!r} has no 'question'")
    await _turns(task, client, episode)
    return 1.0


async def loops(task: dict[str, Any], client: Any, episode: Any) -> float:
    """Calls the model until refused (max_turns); the refusal propagates."""
    await _turns(task, client, episode, turns=1000)
    return 1.0


async def loops_then_scores(task: dict[str, Any], client: Any, episode: Any) -> float:
    """Calls the model until refused, then returns its reward anyway (a truncated episode)."""
    with contextlib.suppress(Exception):
        await _turns(task, client, episode, turns=1000)
    return 0.5


def solve_sync(task: dict[str, Any], client: Any, episode: Any) -> float:
    """A plain function agent, given a sync `openai.OpenAI`."""
    prompt = list(task.get("prompt", [1, 2, 3]))
    for _ in range(task.get("turns", 2)):
        answer = client.completions.create(model="m", prompt=prompt, max_tokens=4)
        prompt = prompt + answer.choices[0].token_ids + TOOL_RESULT
    return 1.0


def calls_until_refused(task: dict[str, Any], client: Any, episode: Any) -> float:
    """A harness with a client of its own (as a CLI agent has, on `episode.base_url`), in a plain function
    (a thread: nothing can cancel it), calling the model until a call is refused."""
    import openai

    own = openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    prompt = list(task.get("prompt", [1, 2, 3]))
    while True:
        try:
            answer = own.completions.create(model="m", prompt=prompt, max_tokens=4)
        except Exception as exc:
            _event(kind="refused", session=episode.session_id, status=getattr(exc, "status_code", None),
                   error=type(exc).__name__)
            raise
        _event(kind="turn", session=episode.session_id)
        prompt = prompt + answer.choices[0].token_ids + TOOL_RESULT


@contextlib.asynccontextmanager
async def sandbox(task: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """An environment: set up before the first turn, torn down however the episode ends."""
    _event(kind="setup", task=task.get("id"))
    try:
        yield {"task": task.get("id"), "pid": os.getpid()}
    finally:
        _event(kind="teardown", task=task.get("id"))


async def in_sandbox(task: dict[str, Any], client: Any, episode: Any) -> float:
    assert episode.env["task"] == task.get("id")
    await _turns(task, client, episode, turns=1)
    if task.get("fail"):
        raise RuntimeError("the task's check failed")
    if task.get("hang"):
        await asyncio.sleep(3600)
    return 1.0


in_sandbox.environment = sandbox  # type: ignore[attr-defined]


async def text_turns(task: dict[str, Any], client: Any, episode: Any) -> float:
    """Two completion turns on the task's text prompt (TRL's prompts are text): the second extends the
    first with its sampled token ids and a tool result, as ids, since the tiny model (the TRL test's)
    samples ids its char tokenizer has no text for (70, 71), and text rebuilt from the answer's text
    would then not extend the first turn (a prefix break). The reward favours short first answers."""
    from tests.helpers.models import token_id

    prompt = str(task["prompt"])
    first = await client.completions.create(model="m", prompt=prompt, max_tokens=6)
    ids = [token_id(c) for c in prompt] + first.choices[0].token_ids + [token_id(c) for c in " ok "]
    await client.completions.create(model="m", prompt=ids, max_tokens=6)
    return 1.0 / (1 + len(first.choices[0].token_ids))


async def solve_or_hang(task: dict[str, Any], client: Any, episode: Any) -> float:
    """`solve`, or hangs after one turn when the task says `hang` (an episode only a cancel ends)."""
    if task.get("hang"):
        await _turns(task, client, episode, turns=1)
        await asyncio.sleep(3600)
    return (await solve(task, client, episode))["reward"]


async def hangs_first(task: dict[str, Any], client: Any, episode: Any) -> float:
    """Hangs after one turn in its first attempt (until its worker stops it); `solve` in the next."""
    if episode.attempt == 1:
        await _turns(task, client, episode, turns=1)
        _event(hung=episode.session_id)
        await asyncio.sleep(3600)
    return (await solve(task, client, episode))["reward"]
