"""The sglang-http engine behind the real SGLang Model Gateway (`smg`, pinned in the test extra)
in front of two stand-in servers: generation through the gateway, lifecycle calls to each server."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import pipeline
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from tests.helpers.models import token_id
from tests.helpers.processes import free_port, terminate, wait_until
from tests.workers.engines.conftest import Standin, launch, stop, wait_ready
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.engines.sglang.http_engine import SGLangHTTPEngine
from workers.errors import EngineUnavailableError

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


def launch_gateway(log: Path, *server_urls: str, policy: str = "round_robin") -> Gateway:
    """`smg launch` on free loopback ports (round robin: both servers get work); waits until ready."""
    if importlib.util.find_spec("smg") is None:
        pytest.fail("the smg gateway is not installed: pip install -e '.[test]' (make test does)")
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--policy", policy,
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


def test_a_worker_process_behind_the_gateway_writes_rows_with_routed_experts(
    gateway: Gateway, servers: tuple[Standin, Standin], redis_url: str, pipeline_env: dict[str, str], tmp_path: Path
) -> None:
    lines = [{"id": f"w{i}", "input_ids": [token_id(c) for c in "ab"], "return_routed_experts": True,
              "sampling_params": {"max_new_tokens": 8, "temperature": 0}} for i in range(4)]
    batch = pipeline.connect(redis_url).submit(lines, run="gw", output=f"file://{tmp_path / 'out'}", batch_size=2)
    worker = subprocess.run(
        [*PIPELINE, "worker", "--engine", "sglang-http", "--url", gateway.url, "--routed-experts",
         "--experts-layout", "2,2,8", "--burst", "--log-level", "WARNING"],
        env=pipeline_env, capture_output=True, text=True, timeout=120,
    )
    assert worker.returncode == 0, worker.stderr
    batch.wait(timeout=30)
    rows = batch.read().to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == ["w0:0", "w1:0", "w2:0", "w3:0"]
    for row in rows:
        assert row["routed_experts_shape"] == [2 + len(row["completion_token_ids"]) - 1, 2, 2]
        assert len(row["routed_experts"]) == 2 * 2 * row["routed_experts_shape"][0]


def test_a_weight_push_pause_continue_and_flush_reach_both_servers(
    engine: SGLangHTTPEngine, servers: tuple[Standin, Standin]
) -> None:
    marks = [len(s.stats()["lifecycle"]) for s in servers]
    version = engine.weight_version + 11
    engine.update_weights(str(servers[0].model_dir), version)
    samples = [o[0] for o in engine.generate([req(f"v{i}") for i in range(4)])]
    assert {s.weight_version for s in samples} == {version}
    assert {info["weight_version"] for info in engine.model_info().values()} == {str(version)}

    engine.pause_generation("in_place")
    try:
        since = rid_counts(servers)
        future = engine.submit([req("paused")])
        wait_for_rid(servers, "paused-", since)
        assert not future.done(), "a request finished while every server was paused"
    finally:
        engine.continue_generation()
    [[sample]] = future.result(timeout=30)
    assert sample.finish.kind == "stop"
    engine.flush_cache()
    engine.health()  # through the gateway, which serves /health_generate

    for server, mark in zip(servers, marks, strict=True):
        calls = lifecycle(server, mark)
        assert [path for path, _ in calls] == [
            "/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache"
        ], server.url
        assert calls[0][1]["weight_version"] == str(version) and calls[1][1] == {"mode": "in_place"}


def rid_counts(servers: tuple[Standin, ...]) -> list[int]:
    return [len(s.stats()["rids"]) for s in servers]


def wait_for_rid(servers: tuple[Standin, ...], prefix: str, since: list[int]) -> tuple[Standin, str]:
    """The server the gateway sent the request whose rid starts with `prefix` (among the rids the
    servers received after `since`, from `rid_counts`), and that rid."""
    found: list[tuple[Standin, str]] = []

    def arrived() -> bool:
        found[:] = [(s, rid) for s, mark in zip(servers, since, strict=True)
                    for rid in s.stats()["rids"][mark:] if rid.startswith(prefix)]
        return bool(found)

    wait_until(arrived, timeout=30, what=f"a request {prefix}* to reach a server")
    [(holder, rid)] = found
    return holder, rid


def held(engine: SGLangHTTPEngine, servers: tuple[Standin, Standin], name: str) -> tuple[Future, Standin, str]:
    """Request `name` submitted and held on whichever server the gateway picked: its future, that
    server, its SGLang rid."""
    for server in servers:
        server.faults(delays={name: 60.0})
    since = rid_counts(servers)
    future = engine.submit([req(name)])
    holder, rid = wait_for_rid(servers, f"{name}-", since)
    return future, holder, rid


def test_an_abort_by_rid_reaches_the_server_holding_the_request(
    engine: SGLangHTTPEngine, servers: tuple[Standin, Standin]
) -> None:
    future, holder, rid = held(engine, servers, "held")
    answers = engine.abort(rid)
    assert set(answers) == {s.url for s in servers}
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers.values())
    [[sample]] = future.result(timeout=30)
    assert sample.finish.kind == "abort" and len(sample.token_ids) == 0
    assert {"rid": rid} in holder.stats()["abort_requests"]


def test_a_cancelled_batch_is_aborted_on_the_server_behind_the_gateway(
    engine: SGLangHTTPEngine, servers: tuple[Standin, Standin]
) -> None:
    future, holder, rid = held(engine, servers, "cancelled")
    future.cancel()
    wait_until(lambda: {"rid": rid} in holder.stats()["abort_requests"], timeout=30,
               what=f"the abort of {rid} to reach {holder.url}")
    wait_until(lambda: holder.stats()["answered_aborted"] > 0, timeout=30, what="the server to stop the request")


def test_an_interrupt_stops_only_this_workers_requests_on_the_shared_servers(
    engine: SGLangHTTPEngine, gateway: Gateway, servers: tuple[Standin, Standin]
) -> None:
    """Two workers behind one gateway: a partial swap in one aborts its own requests by rid, not
    everything on the servers (`abort_all` would cut the other worker's samples short)."""
    other = SGLangHTTPEngine([gateway.url])
    try:
        mine, _holder, my_rid = held(engine, servers, "mine")
        theirs, their_holder, their_rid = held(other, servers, "theirs")
        assert engine.interrupt() == 1
        [[sample]] = mine.result(timeout=30)
        assert sample.finish.kind == "abort"
        assert not theirs.done(), "the other worker's request was stopped too"
        aborted = [body for s in servers for body in s.stats()["abort_requests"]]
        assert {"rid": my_rid} in aborted and {"rid": their_rid} not in aborted
        assert not any(body.get("abort_all") for body in aborted)
        other.abort(their_rid)
        [[theirs_sample]] = theirs.result(timeout=30)
        assert theirs_sample.finish.kind == "abort" and {"rid": their_rid} in their_holder.stats()["abort_requests"]
    finally:
        other.close()


def test_a_gateway_without_servers_is_a_start_up_error(tmp_path: Path) -> None:
    empty = launch_gateway(tmp_path / "smg.log")
    try:
        with pytest.raises(EngineUnavailableError, match=f"{empty.url}: the gateway lists no SGLang servers"):
            SGLangHTTPEngine([empty.url])
    finally:
        stop_gateway(empty)


def test_servers_removed_from_and_added_to_the_gateway_mid_run(
    engine: SGLangHTTPEngine, gateway: Gateway, servers: tuple[Standin, Standin], tmp_path: Path
) -> None:
    a, b = servers
    doomed = launch(a.model_dir, tmp_path / "doomed.log")
    try:
        wait_ready(doomed)
        gateway.add(doomed.url)
        wait_until(lambda: gateway.ready({a.url, b.url, doomed.url}), timeout=60, what="the gateway to add it")
        behind_three = SGLangHTTPEngine([gateway.url])
        try:
            assert sorted(behind_three.servers) == sorted([a.url, b.url, doomed.url])
            # A dead server the gateway still lists fails the call, naming what to do.
            stop(doomed)
            with pytest.raises(EngineUnavailableError,
                               match=f"{doomed.url}: cannot connect.*the gateway {gateway.url} lists it.*DELETE"):
                behind_three.flush_cache()
            # Taken out of the gateway, it is dropped: the failed call reads the list again.
            gateway.remove(doomed.url)
            behind_three.flush_cache()
            assert sorted(behind_three.servers) == sorted([a.url, b.url])
            assert all(o[0].finish.kind == "stop" for o in behind_three.generate([req(f"left{i}") for i in range(4)]))
        finally:
            behind_three.close()
    finally:
        stop(doomed)

    # A live server taken out gets no push; put back, the next push reaches it again.
    marks = [len(s.stats()["lifecycle"]) for s in servers]
    gateway.remove(b.url)
    try:
        engine.update_weights(str(a.model_dir), engine.weight_version + 1)
        assert engine.servers == [a.url]
        assert [p for p, _ in lifecycle(a, marks[0])] == ["/update_weights_from_disk"]
        assert lifecycle(b, marks[1]) == []
    finally:
        gateway.add(b.url)
        wait_until(lambda: gateway.ready({a.url, b.url}), timeout=60, what="the gateway to take b back")
    engine.update_weights(str(a.model_dir), engine.weight_version + 1)
    assert sorted(engine.servers) == sorted([a.url, b.url])
    assert [p for p, _ in lifecycle(b, marks[1])] == ["/update_weights_from_disk"]


# -- routing keys: a session's turns on one server ----------------------------------------------


def sessions(turns: int, sessions: int, *, keyed: bool = True) -> list[RolloutRequest]:
    """`turns` requests of each of `sessions` sessions (ids s00t0, s00t1, ...), routed by session when `keyed`."""
    return [req(f"s{k:02d}t{t}", **({"routing_key": f"session-{k:02d}"} if keyed else {}))
            for t in range(turns) for k in range(sessions)]


def servers_of_sessions(servers: tuple[Standin, Standin], since: list[int]) -> dict[str, set[str]]:
    """The servers each session's requests reached (after `since`, from `rid_counts`)."""
    reached: dict[str, set[str]] = {}
    for server, mark in zip(servers, since, strict=True):
        for rid in server.stats()["rids"][mark:]:
            reached.setdefault(rid[:3], set()).add(server.url)  # "s07t2-..." -> "s07"
    return reached


@pytest.fixture(scope="module")
def hashing_gateway(servers: tuple[Standin, Standin], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """smg with `--policy consistent_hashing`: it hashes the `X-SMG-Routing-Key` header (see
    `workers.engines.sglang.client`)."""
    gateway = launch_gateway(tmp_path_factory.mktemp("smg-hash") / "smg.log", *(s.url for s in servers),
                             policy="consistent_hashing")
    yield gateway
    stop_gateway(gateway)


def test_the_gateway_keeps_a_sessions_turns_on_one_server_by_its_routing_key(
    hashing_gateway: Gateway, servers: tuple[Standin, Standin]
) -> None:
    engine = SGLangHTTPEngine([hashing_gateway.url])
    try:
        since = rid_counts(servers)
        engine.generate(sessions(3, 13))  # all at once: the gateway's hash has no load bound
        reached = servers_of_sessions(servers, since)
        assert len(reached) == 13
        assert all(len(urls) == 1 for urls in reached.values()), reached
        assert set().union(*reached.values()) == {s.url for s in servers}  # sessions spread over both

        since = rid_counts(servers)  # without the key the gateway places each request at random
        engine.generate(sessions(3, 13, keyed=False))
        assert any(len(urls) > 1 for urls in servers_of_sessions(servers, since).values())
    finally:
        engine.close()


def test_several_server_urls_keep_a_sessions_turns_on_one_server_by_its_routing_key(
    servers: tuple[Standin, Standin]
) -> None:
    """No gateway: the engine's own pool picks the server per routing key (one turn of a session at
    a time, as an agent sends them; the pool's load bound is `tests/workers/engines/http`'s topic)."""
    engine = SGLangHTTPEngine([s.url for s in servers])
    try:
        since = rid_counts(servers)
        for request in sessions(3, 13):
            engine.generate([request])
        reached = servers_of_sessions(servers, since)
        assert len(reached) == 13
        assert all(len(urls) == 1 for urls in reached.values()), reached
        assert set().union(*reached.values()) == {s.url for s in servers}

        since = rid_counts(servers)  # without the key: least loaded in turn; 13 per round, so a turn alternates
        for request in sessions(3, 13, keyed=False):
            engine.generate([request])
        assert any(len(urls) > 1 for urls in servers_of_sessions(servers, since).values())
    finally:
        engine.close()
