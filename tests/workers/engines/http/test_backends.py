"""`Backends` over `httpx.MockTransport`: what counts as a gateway, and how its server list is
read again when servers come and go. (The real gateway is in test_sglang_gateway.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from workers.engines.http.backends import Backends, parse_weight_version
from workers.errors import EngineUnavailableError

GW = "http://gw:30000"
S1, S2, S3 = "http://s1:30000", "http://s2:30000", "http://s3:30000"


class Cluster:
    """A gateway at GW listing `listed`; every server records the calls it gets."""

    def __init__(self, listed: list[str], workers_answer: Callable[[], httpx.Response] | None = None) -> None:
        self.listed = listed
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, Any]] = []
        self.workers_answer = workers_answer

    def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if base == GW:
            if request.url.path == "/workers":
                if self.workers_answer is not None:
                    return self.workers_answer()
                return httpx.Response(200, json={"workers": [
                    {"id": f"id-{u[7:9]}", "url": u, "status": "not_ready" if u in self.down else "ready",
                     "is_healthy": u not in self.down} for u in self.listed
                ]})
            return httpx.Response(404, json={"error": {"code": "unknown_url"}})
        if request.url.path == "/workers":
            return httpx.Response(404, json={"detail": "Not Found"})
        self.calls.append((base, request.url.path, json.loads(request.content) if request.content else None))
        return httpx.Response(200, json={"success": True})

    def backends(self, urls: list[str]) -> Backends:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handle))
        return Backends(urls, lambda: client)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_before_discovery_each_url_is_its_own_server() -> None:
    backends = Cluster([S1]).backends([GW, S3])
    assert backends.servers() == [GW, S3] and backends.servers(via=GW) == [GW]


def test_a_gateway_stands_for_the_servers_it_lists_and_a_server_for_itself() -> None:
    backends = Cluster([S1, S2]).backends([GW, S3, S1])
    run(backends.discover())
    assert backends.gateways == {GW}
    assert backends.servers() == [S1, S2, S3]
    assert backends.servers(via=GW) == [S1, S2] and backends.servers(via=S3) == [S3]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (lambda: httpx.Response(200, json={"workers": []}), "lists no SGLang servers"),
        (lambda: httpx.Response(200, json={"urls": [S1]}), "not a gateway's"),
        (lambda: httpx.Response(200, text="<html>"), "not a gateway's"),
        (lambda: httpx.Response(200, json={"workers": [{"url": "grpc://s1:30001"}]}), "cannot call over HTTP"),
        (lambda: httpx.Response(500, json={"error": "boom"}), "HTTP 500: boom"),
    ],
)
def test_a_gateway_without_usable_servers_is_a_clear_error(answer: Callable[[], httpx.Response], error: str) -> None:
    backends = Cluster([], workers_answer=answer).backends([GW])
    with pytest.raises(EngineUnavailableError, match=f"{GW}: .*{error}"):
        run(backends.discover())


def test_an_unreachable_url_is_named() -> None:
    cluster = Cluster([S1])
    cluster.down.add(GW)
    with pytest.raises(EngineUnavailableError, match=f"{GW}: cannot connect"):
        run(cluster.backends([GW]).discover())


def test_a_failed_call_reads_the_list_again_dropping_servers_that_left_and_calling_those_that_joined() -> None:
    cluster = Cluster([S1, S2])
    backends = cluster.backends([GW])
    run(backends.discover())
    cluster.down.add(S2)          # S2 died and the gateway dropped it; S3 joined
    cluster.listed = [S1, S3]
    answers = run(backends.fan_out("POST", "/flush_cache"))
    assert list(answers) == [S1, S3]
    assert all(a.status_code == 200 for a in answers.values())
    assert [(url, path) for url, path, _ in cluster.calls] == [(S1, "/flush_cache"), (S3, "/flush_cache")]


def test_a_server_still_listed_that_fails_stays_a_failure() -> None:
    cluster = Cluster([S1, S2])
    backends = cluster.backends([GW])
    run(backends.discover())
    cluster.down.add(S2)
    answers = run(backends.fan_out("POST", "/pause_generation", {"mode": "abort"}))
    assert isinstance(answers[S2], httpx.ConnectError) and answers[S1].status_code == 200
    said = backends.describe(S2, answers[S2])
    assert said.startswith(f"{S2}: cannot connect")
    assert f"the gateway {GW} lists it: status=not_ready, is_healthy=False" in said
    assert f"DELETE {GW}/workers/id-s2" in said


def test_rediscover_reads_the_list_before_the_call() -> None:
    cluster = Cluster([S1])
    backends = cluster.backends([GW])
    run(backends.discover())
    cluster.listed = [S1, S2]
    run(backends.fan_out("POST", "/update_weights_from_disk", {"model_path": "/m"}, rediscover=True))
    assert sorted(url for url, _, _ in cluster.calls) == [S1, S2]


def test_abort_goes_to_every_server_behind_the_gateway() -> None:
    cluster = Cluster([S1, S2])
    backends = cluster.backends([GW, S3])
    run(backends.discover())
    assert set(run(backends.abort("r-1"))) == {S1, S2, S3}
    cluster.calls.clear()
    run(backends.abort("r-2", via=GW))
    assert cluster.calls == [(S1, "/abort_request", {"rid": "r-2"}), (S2, "/abort_request", {"rid": "r-2"})]
    cluster.calls.clear()
    run(backends.abort_all())
    assert {(url, body["abort_all"]) for url, _, body in cluster.calls} == {(S1, True), (S2, True), (S3, True)}


def test_a_url_that_is_neither_a_server_nor_a_gateway_is_a_clear_start_up_error() -> None:
    from workers.engines.sglang.http_engine import SGLangHTTPEngine

    with pytest.raises(EngineUnavailableError, match=f"{S1} serve.* neither GET /model_info nor GET /get_model_info"):
        SGLangHTTPEngine([S1], transport=httpx.MockTransport(lambda request: httpx.Response(404)))


@pytest.mark.parametrize(("value", "expected"), [("default", None), ("42", 42), (7, 7), (None, None),
                                                  ("step-3", None), (True, None)])
def test_weight_version(value: Any, expected: int | None) -> None:
    assert parse_weight_version(value) == expected
