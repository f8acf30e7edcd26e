"""The sglang-http engine behind the real SGLang Model Gateway (`smg`, pinned in the test extra)
in front of two stand-in servers: generation through the gateway, lifecycle calls to each server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas.request import RolloutRequest
from tests.helpers import free_port, terminate, wait_until
from tests.models import token_id
from tests.workers.engines.conftest import Standin
from workers.engines.routed_experts import ExpertsLayout
from workers.engines.sglang_http import SGLangHTTPEngine

LIFECYCLE = ("/update_weights_from_disk", "/pause_generation", "/continue_generation", "/abort_request")


@dataclass
class Gateway:
    """One running `smg launch` process."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]}

    def ready(self, urls: set[str]) -> bool:
        workers = self.workers()
        return set(workers) == urls and all(w.get("status") == "ready" and w["is_healthy"] for w in workers.values())

    def add(self, url: str) -> None:
        httpx.post(f"{self.url}/workers", json={"url": url}, timeout=5).raise_for_status()

    def remove(self, url: str) -> None:
        worker_id = self.workers()[url]["id"]
        httpx.delete(f"{self.url}/workers/{worker_id}", timeout=5).raise_for_status()
        wait_until(lambda: url not in self.workers(), timeout=30, what=f"the gateway to drop {url}")


def launch_gateway(log: Path, *server_urls: str) -> Gateway:
    """`smg launch` on free loopback ports, round robin so both servers get work; waits until ready."""
    if importlib.util.find_spec("smg") is None:
        pytest.fail("the smg gateway is not installed: pip install -e '.[test]' (make test does)")
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", "round_robin",
             "--log-level", "warn", "--shutdown-grace-period-secs", "1",
             *(["--worker-urls", *server_urls] if server_urls else [])],
            stdout=out, stderr=subprocess.STDOUT,
        )
    gateway = Gateway(f"http://127.0.0.1:{port}", process, log)

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited:\n{log.read_text()}")
        try:
            return gateway.ready(set(server_urls))
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=60, what=f"smg to list {server_urls} as ready")
    except BaseException:
        stop_gateway(gateway)
        raise
    return gateway


def stop_gateway(gateway: Gateway) -> None:
    terminate(gateway.process, timeout=10)


@pytest.fixture(scope="module")
def servers(standins: dict[str, Standin]) -> tuple[Standin, Standin]:
    return standins["scripted"], standins["scripted_b"]


@pytest.fixture(scope="module")
def gateway(servers: tuple[Standin, Standin], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gateway = launch_gateway(tmp_path_factory.mktemp("smg") / "smg.log", *(s.url for s in servers))
    yield gateway
    stop_gateway(gateway)


@pytest.fixture
def engine(gateway: Gateway, servers: tuple[Standin, Standin]) -> Iterator[SGLangHTTPEngine]:
    for server in servers:
        server.clear_faults()
    engine = SGLangHTTPEngine([gateway.url], routed_experts=True,
                              experts_layout=ExpertsLayout(layers=2, top_k=2, num_experts=8))
    yield engine
    engine.close()
    for server in servers:
        server.clear_faults()


def req(rid: str, prompt: str = "ab", **fields: Any) -> RolloutRequest:
    return RolloutRequest.model_validate({"id": rid, "input_ids": [token_id(c) for c in prompt],
                                          "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, **fields})


def lifecycle(server: Standin, since: int = 0) -> list[tuple[str, Any]]:
    """The lifecycle calls `server` received (after the first `since`), as (path, body)."""
    return [(path, body) for _method, path, body in server.stats()["lifecycle"][since:]]


def test_the_gateway_serves_generation_but_not_the_lifecycle_calls(gateway: Gateway) -> None:
    """Why the engine fans lifecycle calls out itself: smg 1.13.0 answers 404 to each."""
    assert httpx.get(f"{gateway.url}/model_info", timeout=5).status_code == 404
    assert httpx.get(f"{gateway.url}/get_model_info", timeout=5).status_code == 200
    for path in LIFECYCLE:
        assert httpx.post(f"{gateway.url}{path}", json={}, timeout=5).status_code == 404, path


def test_the_engine_starts_behind_the_gateway_and_finds_both_servers(
    engine: SGLangHTTPEngine, gateway: Gateway, servers: tuple[Standin, Standin]
) -> None:
    assert engine.urls == [gateway.url]
    assert sorted(engine.servers) == sorted(s.url for s in servers)
    assert engine.description.model == str(servers[0].model_dir)


def test_generation_spreads_over_both_servers_and_keeps_routed_experts(
    engine: SGLangHTTPEngine, servers: tuple[Standin, Standin]
) -> None:
    before = [s.stats()["generate"] for s in servers]
    requests = [req(f"spread{i}", return_routed_experts=True) for i in range(8)]
    outputs = engine.generate(requests)
    served = [s.stats()["generate"] - b for s, b in zip(servers, before, strict=True)]
    assert sum(served) == 8 and min(served) >= 2, served
    for [sample] in outputs:
        assert sample.token_ids.tolist() == [token_id(c) for c in "cde"] + [0]
        assert sample.routed_experts is not None
        assert sample.routed_experts.shape == (2 + len(sample.token_ids) - 1, 2, 2)
