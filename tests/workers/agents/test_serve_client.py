"""The agent worker's calls to `pipeline serve` ride out a server restart: a session whose creation
answer was lost (the server made it, then died) is not a failed episode when the retry finds it made."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from workers.agents.serve_client import ServeClient
from workers.errors import EpisodeError


def _server(made: set[str], lose_first_answer: bool) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        session = request.read().decode()
        if session in made:
            return httpx.Response(409, json={"error": {"message": "exists already"}})
        made.add(session)
        if lose_first_answer:
            raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)
        return httpx.Response(201, json={"session_id": "s"})
    return httpx.MockTransport(handle)


def test_a_session_made_by_a_call_whose_answer_was_lost_is_opened_on_the_retry() -> None:
    made: set[str] = set()
    client = ServeClient("http://serve", transport=_server(made, lose_first_answer=True))
    asyncio.run(client.open_session("ep-1", "run", {}))
    assert len(made) == 1


def test_a_refusal_other_than_that_fails_the_attempt_with_the_servers_words() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "run name is not valid"}})

    client = ServeClient("http://serve", transport=httpx.MockTransport(refuse))
    with pytest.raises(EpisodeError, match=r"refused POST /sessions: 400 .*run name is not valid") as caught:
        asyncio.run(client.open_session("ep-1", "run", {}))
    assert caught.value.retry is False
