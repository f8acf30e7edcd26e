"""The SGLang HTTP client's retry, failover and abort logic, through `httpx.MockTransport`.

No server process: each test scripts what the servers answer, request by request, and checks
what the client sent (URLs, rids, aborts) and what it raised. The protocol itself is tested
against stand-in server processes in test_sglang_http.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from schemas.request import RolloutRequest
from workers.engines.sglang.client import RetryPolicy, SGLangClient
from workers.engines.sglang.mapping import GenerateCall, generate_calls
from workers.errors import ContractViolation, EngineUnavailableError, UnsupportedRequestError

FAST = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=0.002, down_cooldown_s=60.0)
A, B = "http://a:30000", "http://b:30000"
OK = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}}


def call(n: int = 1) -> GenerateCall:
    request = RolloutRequest.model_validate({"id": "q", "input_ids": [1, 2], "sampling_params": {"n": n}})
    [only] = generate_calls(request, rid_prefix="rid")
    return only


class Servers:
    """Scripted answers per (URL, path); records every request the client sent."""

    def __init__(self, answers: dict[tuple[str, str], list[Callable[[httpx.Request], Any]]]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else {}
        self.sent.append((base, request.url.path, body))
        script = self.answers.get((base, request.url.path))
        if not script:
            return httpx.Response(200, json={})
        answer = script.pop(0) if len(script) > 1 else script[0]
        result = answer(request)
        return await result if asyncio.iscoroutine(result) else result

    def generates(self) -> list[tuple[str, str]]:
        return [(url, body["rid"]) for url, path, body in self.sent if path == "/generate"]

    def aborts(self) -> list[tuple[str, str]]:
        return [(url, body["rid"]) for url, path, body in self.sent if path == "/abort_request"]


def respond(status: int, body: Any = None) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json=body if body is not None else OK)


def fail(error: type[httpx.TransportError]) -> Callable[[httpx.Request], httpx.Response]:
    def raise_(request: httpx.Request) -> httpx.Response:
        raise error("scripted failure", request=request)
    return raise_


def run(servers: Servers, the_call: GenerateCall, urls: tuple[str, ...] = (A,)) -> tuple[str, Any]:
    async def go() -> tuple[str, Any]:
        client = SGLangClient(list(urls), retry=FAST, transport=httpx.MockTransport(servers))
        try:
            return await client.generate(the_call)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_a_5xx_is_retried_under_a_fresh_rid() -> None:
    servers = Servers({(A, "/generate"): [respond(503, {"error": {"message": "overloaded"}}), respond(200)]})
    assert run(servers, call()) == (A, OK)
    assert servers.generates() == [(A, "rid"), (A, "rid-r1")]
    assert servers.aborts() == []  # a 5xx answer means nothing is generating


def test_a_refused_connection_fails_over_to_the_other_url_without_abort() -> None:
    servers = Servers({(A, "/generate"): [fail(httpx.ConnectError)], (B, "/generate"): [respond(200)]})
    url, _ = run(servers, call(), urls=(A, B))
    assert url == B and servers.generates() == [(A, "rid"), (B, "rid-r1")]
    assert servers.aborts() == []  # never sent: nothing to abort


def test_a_dropped_answer_aborts_the_rid_it_may_still_generate_then_retries() -> None:
    servers = Servers({(A, "/generate"): [fail(httpx.ReadError), respond(200)]})
    assert run(servers, call()) == (A, OK)
    assert servers.aborts() == [(A, "rid")]
    assert servers.generates() == [(A, "rid"), (A, "rid-r1")]


def test_a_4xx_is_the_requests_fault_and_is_not_retried() -> None:
    servers = Servers({(A, "/generate"): [respond(400, {"error": {"message": "max_new_tokens too large"}})]})
    with pytest.raises(UnsupportedRequestError, match="HTTP 400: max_new_tokens too large"):
        run(servers, call())
    assert len(servers.generates()) == 1


def test_a_read_timeout_aborts_and_is_not_retried() -> None:
    servers = Servers({(A, "/generate"): [fail(httpx.ReadTimeout)]})
    with pytest.raises(EngineUnavailableError, match="did not answer within the timeout"):
        run(servers, call())
    assert len(servers.generates()) == 1 and servers.aborts() == [(A, "rid")]


def test_giving_up_after_the_attempts_names_the_last_error() -> None:
    servers = Servers({(A, "/generate"): [respond(502, {"detail": "bad gateway"})]})
    with pytest.raises(EngineUnavailableError, match=r"after 3 attempts; last error: .*HTTP 502: bad gateway"):
        run(servers, call())
    assert servers.generates() == [(A, "rid"), (A, "rid-r1"), (A, "rid-r2")]


def test_a_body_that_is_not_json_is_a_contract_violation() -> None:
    servers = Servers({(A, "/generate"): [lambda request: httpx.Response(200, text="<html>")]})
    with pytest.raises(ContractViolation, match="not JSON"):
        run(servers, call())


def test_a_call_cancelled_in_flight_aborts_every_sample_rid() -> None:
    started = asyncio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("not reached")

    servers = Servers({(A, "/generate"): [hang]})

    async def go() -> None:
        client = SGLangClient([A], retry=FAST, transport=httpx.MockTransport(servers))
        task = asyncio.create_task(client.generate(call(n=2)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.aborted == ["rid_0", "rid_1"]
        await client.aclose()

    asyncio.run(go())
    assert servers.aborts() == [(A, "rid_0"), (A, "rid_1")]  # SGLang expands an n-call's rid per sample


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0)
    for retry, full in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (9, 3.0)]:
        delays = [policy.delay(retry) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays), (retry, min(delays), max(delays))


def test_requests_are_logged_at_debug_not_info(caplog: pytest.LogCaptureFixture) -> None:
    servers = Servers({(A, "/generate"): [respond(200)]})
    caplog.set_level("INFO")
    run(servers, call())
    logged = [r for r in caplog.records if r.getMessage().startswith("POST ")]
    assert not logged  # a busy worker sends thousands a second
    caplog.set_level("DEBUG")
    run(servers, call())
    [record] = [r for r in caplog.records if r.getMessage().startswith("POST ")]
    assert record.levelname == "DEBUG" and record.getMessage() == "POST http://a:30000/generate: HTTP 200"
