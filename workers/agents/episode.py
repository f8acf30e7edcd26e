"""What an agent is given besides its task and client: the episode it is running.

    async def solve(task: dict, client: openai.AsyncOpenAI, episode: Episode) -> float | dict:
        ...

`episode.base_url` is the session's OpenAI base URL, for a harness that makes its own client or
spawns its own process (a CLI agent); `episode.env` is what the agent's environment gave this
episode (None without one); `episode.turns` counts the model calls made so far. A call past
`max_turns` is refused before it is sent (the client raises); an agent that returns a reward anyway
ends the episode truncated (`info["truncated"]`), one that raises fails it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    run: str
    task_id: str
    sample: int
    attempt: int  # 1, then one more per retry or take-over; each attempt is a fresh session
    session_id: str
    base_url: str  # `<serve>/sessions/<session_id>/v1`
    api_key: str
    trace_id: str
    max_turns: int | None
    env: Any = None
    turns: int = field(default=0)
    refused: int = field(default=0)  # calls refused past max_turns

    @property
    def episode_id(self) -> str:
        return f"{self.task_id}:{self.sample}"
