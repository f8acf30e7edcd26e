"""One attempt of one episode: the environment set up, the agent run against a fresh session under
the time limit, the environment torn down (always: success, error, timeout, cancel), the reward checked.

An agent is `solve(task, client, episode) -> reward`, async (given an `openai.AsyncOpenAI`) or not
(given an `openai.OpenAI`, run in a thread). The reward is a finite number, or a dict holding one
under "reward" with anything else JSON-serialisable beside it (kept as the episode's `info`).
An agent carrying an `environment` attribute (a callable of the task returning an async or plain
context manager) gets what it enters as `episode.env`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from pipeline.core.agents import is_async
from workers.agents.episode import Episode
from workers.agents.serve_client import ServeClient
from workers.errors import EpisodeError

TEARDOWN_S = 60.0  # the longest an environment's teardown may take before it is abandoned


def check_reward(result: Any) -> tuple[float, dict[str, Any]]:
    """The reward and info an agent returned; `EpisodeError` (not retried) when it is not one."""
    info: dict[str, Any] = {}
    value = result
    if isinstance(result, dict):
        if "reward" not in result:
            raise EpisodeError(f"the agent returned a dict without 'reward' (keys: {sorted(result)[:8]}): return "
                               "the reward, or {'reward': NUMBER, ...}", retry=False)
        value = result["reward"]
        info = {k: v for k, v in result.items() if k != "reward"}
        try:
            json.dumps(info)
        except (TypeError, ValueError) as exc:
            raise EpisodeError(f"the agent's result beside 'reward' is not JSON ({exc})", retry=False) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EpisodeError(f"the agent returned {value!r} ({type(value).__name__}) as its reward: return a finite "
                           "number, or {'reward': NUMBER, ...}", retry=False)
    return float(value), info


@contextlib.asynccontextmanager
async def environment(agent: Callable[..., Any], task: dict[str, Any]) -> AsyncIterator[Any]:
    """The agent's environment for this task (None when it declares none), torn down however the
    block ends; a teardown that raises is logged by the caller as the attempt's error only if the
    attempt itself succeeded."""
    factory = getattr(agent, "environment", None)
    if factory is None:
        yield None
        return
    manager = factory(task)
    if hasattr(manager, "__aenter__"):
        entered = await manager.__aenter__()
        try:
            yield entered
        except BaseException as exc:
            await asyncio.wait_for(asyncio.shield(manager.__aexit__(type(exc), exc, exc.__traceback__)), TEARDOWN_S)
            raise
        else:
            await asyncio.wait_for(manager.__aexit__(None, None, None), TEARDOWN_S)
    elif hasattr(manager, "__enter__"):
        with manager as entered:
            yield entered
    else:
        raise EpisodeError(f"the agent's environment({task!r:.60}) gave a {type(manager).__name__}, not a context "
                           "manager", retry=False)


async def run(agent: Callable[..., Any], task: dict[str, Any], episode: Episode, serve: ServeClient,
              timeout_s: float | None) -> tuple[float, dict[str, Any]]:
    """Run the attempt; the reward and info, or `EpisodeError` saying why not and whether to retry."""
    asynchronous = is_async(agent)
    client = serve.openai_client(episode, sync=not asynchronous)
    try:
        async with asyncio.timeout(timeout_s):
            async with environment(agent, task) as env:
                episode.env = env
                if asynchronous:
                    result = await agent(task, client, episode)
                else:
                    result = await asyncio.to_thread(agent, task, client, episode)
    except TimeoutError:
        raise EpisodeError(f"timed out after {timeout_s:g} s (--episode-timeout)", retry=True) from None
    except EpisodeError:
        raise
    except Exception as exc:
        if episode.refused:
            raise EpisodeError(f"the agent went on past {episode.max_turns} model calls (--max-turns) and raised "
                               f"{type(exc).__name__}", retry=False) from None
        last = (str(exc).strip().splitlines() or [""])[-1]
        raise EpisodeError(f"the agent raised {type(exc).__name__}: {last}"[:500], retry=True) from exc
    finally:
        closing = client.close()
        if asyncio.iscoroutine(closing):
            await closing
    reward, info = check_reward(result)
    if episode.refused:
        info["truncated"] = True  # it asked for more than max_turns calls, then returned its reward
    if episode.turns == 0:  # a harness with a client of its own (verifiers, a CLI agent): ask the session
        episode.turns = await serve.session_turns(episode.session_id)
    if episode.turns == 0:
        raise EpisodeError("the agent returned without calling the model: an episode with no turn has no "
                           "trajectory to train on", retry=False)
    return reward, info

