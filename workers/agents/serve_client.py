"""An agent worker's side of `pipeline serve`: opening an episode's session, recording its reward,
ending it, and the OpenAI client bound to it (a real base URL: every call is a turn of the session).

The client counts the episode's model calls (`Episode.turns`) and refuses the call past
`max_turns` before it is sent, so an agent that loops is stopped at its limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from workers.agents.episode import Episode
from workers.errors import EpisodeError

TURN_PATHS = ("/chat/completions", "/completions")
OPEN_ATTEMPTS = 8  # a server being restarted: tries, with backoff, before the attempt fails (retryable)


class TurnLimitReached(Exception):
    """A model call past the episode's `max_turns`, refused before it was sent."""


class ServeClient:
    """HTTP calls to one `pipeline serve` (a base URL, an optional API key), shared by a worker's episodes."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or "unused"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)

    async def close(self) -> None:
        await self.http.aclose()

    async def _call(self, method: str, path: str, json: Any = None, *, fine: tuple[int, ...] = ()) -> dict[str, Any]:
        delay = 0.25
        for attempt in range(OPEN_ATTEMPTS):
            try:
                answer = await self.http.request(method, path, json=json)
            except httpx.TransportError as exc:
                if attempt == OPEN_ATTEMPTS - 1:
                    raise EpisodeError(f"pipeline serve at {self.base_url} is unreachable ({exc}); is it running?"
                                       " (agent-worker --serve URL)", retry=True) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
                continue
            if answer.status_code >= 500 and attempt < OPEN_ATTEMPTS - 1:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
                continue
            if answer.status_code in fine:
                return {}
            if answer.status_code >= 400:
                raise EpisodeError(f"pipeline serve refused {method} {path}: {answer.status_code} {answer.text[:300]}",
                                   retry=answer.status_code >= 500)
            return answer.json()
        raise AssertionError("unreachable")

    async def open_session(self, session_id: str, run: str, metadata: dict[str, Any],
                           adapter: str | None = None) -> None:
        # 409, the session exists: this call's own first try made it and its answer was lost (a server
        # restarted mid-call); session ids are random per attempt, so no other call holds this one.
        body = {"session_id": session_id, "run": run, "metadata": metadata}
        await self._call("POST", "/sessions", {**body, "adapter": adapter} if adapter else body, fine=(409,))

    async def session_turns(self, session_id: str) -> int:
        """The turns the session has committed (a harness may call the model with a client of its own)."""
        return int((await self._call("GET", f"/sessions/{session_id}"))["turns"])

    async def end_session(self, session_id: str, reward: float | None = None) -> None:
        """Close the session, recording the episode's reward on it in the same call."""
        await self._call("POST", f"/sessions/{session_id}/end", None if reward is None else {"reward": reward})

    def session_url(self, session_id: str) -> str:
        return f"{self.base_url}/sessions/{session_id}/v1"

    def openai_client(self, episode: Episode, *, sync: bool = False) -> Any:
        """`openai.AsyncOpenAI` (or `openai.OpenAI`) bound to the episode's session, counting its turns."""
        import openai

        def count(request: httpx.Request) -> None:
            if request.method == "POST" and request.url.path.endswith(TURN_PATHS):
                if episode.max_turns is not None and episode.turns >= episode.max_turns:
                    episode.refused += 1
                    raise TurnLimitReached(f"call {episode.turns + 1} is past max_turns {episode.max_turns}")
                episode.turns += 1

        async def count_async(request: httpx.Request) -> None:
            count(request)

        if sync:
            http = httpx.Client(event_hooks={"request": [count]}, timeout=None)
            return openai.OpenAI(base_url=episode.base_url, api_key=episode.api_key, http_client=http)
        http_async = httpx.AsyncClient(event_hooks={"request": [count_async]}, timeout=None)
        return openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, http_client=http_async)
