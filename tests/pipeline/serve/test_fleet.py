"""Sessions across a fleet: turns stay on their home worker (where the prefix is cached), and a
worker killed in the middle of a turn costs the agent latency, not an error (real `pipeline
worker` processes on the sim engine, a real redis-server, the real server over HTTP)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from pipeline.audit import status
from pipeline.core.broker import keys, registry
from pipeline.core.jobs.turn_queue import TURNS
from pipeline.read.lineage_rows import turn_rows
from schemas.turn_job import TurnJob
from tests.conftest import PIPELINE
from tests.helpers.processes import stop_all, wait_until
from tests.helpers.session_calls import turn_ids_in_flight

HEARTBEAT_S = 0.5  # registry entries expire int(3 x 0.5) + 1 = 2 s after a worker's last heartbeat
TOOL_RESULT = list(range(300, 340))  # what the agent's tool "returned" between turns


@pytest.fixture
def sim_workers(pipeline_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """`start(*args)`: a `pipeline worker --engine sim` process (SIGTERM at the end, SIGKILL if it lingers)."""
    processes: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        log = (tmp_path / f"worker{len(processes)}.log").open("w")
        process = subprocess.Popen(
            [*PIPELINE, "worker", "--engine", "sim", "--heartbeat-interval", str(HEARTBEAT_S),
             "--log-level", "WARNING", *args], env=pipeline_env, stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    yield start
    stop_all(processes)


def _live(conn: redis.Redis, count: int) -> list[str]:
    wait_until(lambda: len(registry.live_workers(conn)) == count, timeout=60, what=f"{count} live workers")
    return sorted(w.worker_id for w in registry.live_workers(conn))


def _turn(url: str, session: str, prompt: list[int], max_tokens: int = 64, timeout: float = 60) -> dict[str, Any]:
    answer = httpx.post(f"{url}/sessions/{session}/v1/completions", timeout=timeout,
                        json={"model": "m", "prompt": prompt, "max_tokens": max_tokens})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _served_by(conn: redis.Redis, run: str) -> dict[tuple[str, int], list[str]]:
    served: dict[tuple[str, int], list[str]] = {}
    for row in turn_rows(run, conn).to_pylist():
        served.setdefault((row["session_id"], row["turn"]), []).append(row["worker_id"])
    return served


def test_a_sessions_turns_stay_home_and_find_their_prefix_cached(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen]) -> None:
    for _ in range(2):
        sim_workers("--sim-step-ms", "1", "--sim-median-tokens", "20", "--sim-p99-tokens", "21")
    workers = _live(redis_client, 2)
    stack = serve(tokenizer=None)
    sessions = [stack.session() for _ in range(8)]
    prompts = {s: list(range(1, 101)) for s in sessions}
    for _turn_index in range(4):
        for session in sessions:  # interleaved, as concurrent agents' turns arrive
            answer = _turn(stack.url, session, prompts[session])
            prompts[session] = prompts[session] + answer["choices"][0]["token_ids"] + TOOL_RESULT
    served = _served_by(redis_client, stack.run)
    homes = {}
    for session in sessions:
        by_turn = [served[(session, t)] for t in range(4)]
        assert all(len(w) == 1 for w in by_turn), by_turn  # one row per turn
        assert len({w[0] for w in by_turn}) == 1, f"session {session} moved: {by_turn}"
        homes[session] = by_turn[0][0]
    assert set(homes.values()) == set(workers)  # sessions spread over the pool
    rows = turn_rows(stack.run, redis_client).to_pylist()
    # Each later turn found the whole of its session's last context cached (in 16-token blocks).
    for row in rows:
        if row["turn"] > 0:
            assert row["cached_tokens"] >= row["prompt_tokens"] - len(TOOL_RESULT) - 16, row["turn"]
    # The server writes the pool's counts every half second (`pipeline.serve.turn_counts`).
    wait_until(lambda: _lane_stats(redis_client).get("turns") == 32, timeout=10, what="the turn counts")
    stats = _lane_stats(redis_client)
    assert stats["turns"] == 32 and stats["homed_turns"] == 24 and stats["home_turns"] == 24
    assert stats["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    # What `pipeline status` shows of it.
    shown = status.collect_pool(redis_client, "default")["affinity"]
    assert shown["home_share"] == 1.0 and shown["turns"] == 32 and shown["moves"] == {}
    assert shown["cached_share"] == round(stats["cached_tokens"] / stats["prompt_tokens"], 4) > 0.5
    assert "100.0% of 24 on their session's home worker" in status.format_affinity(shown)
    scraped = httpx.get(f"{stack.url}/metrics", timeout=10)
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    assert 'pipeline_agent_home_turns_total{pool="default"} 24' in scraped.text
    assert f'pipeline_agent_cached_tokens_total{{pool="default"}} {stats["cached_tokens"]}' in scraped.text
    assert 'pipeline_sessions_open{pool="default"} 8' in scraped.text


def test_without_affinity_every_turn_goes_through_the_shared_lane_and_no_rq_job(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen]) -> None:
    """`pipeline serve --no-affinity`: each turn waits in the pool's shared lane (a stream every
    worker reads) for whichever worker takes it; no session has a home, no RQ job is made."""
    for _ in range(2):
        sim_workers("--sim-step-ms", "1", "--sim-median-tokens", "20", "--sim-p99-tokens", "21")
    _live(redis_client, 2)
    stack = serve(tokenizer=None, affinity=False)
    sessions = [stack.session() for _ in range(6)]
    prompts = {s: list(range(1, 41)) for s in sessions}
    for _turn_index in range(3):
        for session in sessions:
            answer = _turn(stack.url, session, prompts[session])
            prompts[session] = prompts[session] + answer["choices"][0]["token_ids"] + TOOL_RESULT
    served = _served_by(redis_client, stack.run)
    assert sorted(served) == sorted((s, t) for s in sessions for t in range(3))
    assert all(len(workers) == 1 for workers in served.values())  # one row a turn
    pool = keys.pool(None)
    assert redis_client.xlen(pool.lane) == 0  # every entry acknowledged and deleted
    assert not any(redis_client.exists(pool.turn_queue(w)) and redis_client.xlen(pool.turn_queue(w))
                   for w in {w for workers in served.values() for w in workers})
    assert not list(redis_client.scan_iter("rq:job:turns-*")) and not list(redis_client.scan_iter("rq:queue:lane*"))
    assert not any(redis_client.zcard(pool.homed_sessions(w.worker_id)) for w in registry.live_workers(redis_client))
    assert status.collect_pool(redis_client, "default")["turns"] == {
        "lane": pool.lane, "lane_queued": 0, "lane_taken": 0, "routed": 0, "taken": 0}


def test_a_call_goes_to_the_worker_that_served_the_call_it_extends(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen]) -> None:
    """Affinity follows the tree: a sub-agent's call served on another worker makes that worker the
    session's home, but the main agent's next call extends a call the first worker served, whose
    cache holds its prefix: it goes there, and a new root goes to the session's home."""
    for _ in range(2):
        sim_workers("--sim-step-ms", "1", "--sim-median-tokens", "20", "--sim-p99-tokens", "21")
    workers = _live(redis_client, 2)
    stack = serve(tokenizer=None)
    session = stack.session()
    main = list(range(1, 101))
    first = _turn(stack.url, session, main)
    [[holder]] = _served_by(redis_client, stack.run).values()
    # The session's latest call was served on the other worker (as a sub-agent's root is when the
    # first is full or gone): that worker is now the session's home.
    other = next(w for w in workers if w != holder)
    redis_client.hset(keys.session(session), "home", other)
    _turn(stack.url, session, list(range(500, 540)))  # a new root: to the session's home
    _turn(stack.url, session, main + first["choices"][0]["token_ids"] + TOOL_RESULT)  # extends call 0
    served = _served_by(redis_client, stack.run)
    assert [served[(session, turn)] for turn in range(3)] == [[holder], [other], [holder]]
    rows = {r["turn"]: r for r in turn_rows(stack.run, redis_client).to_pylist()}
    assert rows[2]["parent_turn"] == 0 and rows[1]["parent_turn"] is None
    assert rows[2]["cached_tokens"] >= rows[2]["prompt_tokens"] - len(TOOL_RESULT) - 16


def test_a_turn_whose_worker_is_killed_runs_again_elsewhere_and_answers_once(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen]) -> None:
    # 400 tokens at 10 ms a step: a turn of about 4 s, long enough to kill its worker in the middle.
    args = ("--sim-step-ms", "10", "--sim-median-tokens", "400", "--sim-p99-tokens", "401")
    processes = [sim_workers(*args), sim_workers(*args)]
    _live(redis_client, 2)
    stack = serve(tokenizer=None)
    session = stack.session()
    first = _turn(stack.url, session, list(range(1, 51)), max_tokens=1000)
    [[home]] = _served_by(redis_client, stack.run).values()
    pid_of = {w.worker_id: w.pid for w in registry.live_workers(redis_client)}
    home_process = next(p for p in processes if p.pid == pid_of[home])

    prompt = list(range(1, 51)) + first["choices"][0]["token_ids"] + TOOL_RESULT
    answers: list[dict[str, Any]] = []
    call = threading.Thread(target=lambda: answers.append(_turn(stack.url, session, prompt, max_tokens=1000,
                                                                timeout=120)))
    call.start()

    def running_at_home() -> bool:  # read from its turn queue: pending to it
        turn_id = _pending_turn_id(redis_client, session)
        stream = keys.pool(None).turn_queue(home)
        held = redis_client.xpending_range(stream, TURNS.group, "-", "+", 100, consumername=home)
        return turn_id is not None and any(
            turn_id in TurnJob.decode(fields[b"job"]).turn_ids
            for entry in held for _, fields in redis_client.xrange(stream, entry["message_id"], entry["message_id"]))

    wait_until(running_at_home, timeout=30, what="turn 1 to start on its home worker")
    os.kill(home_process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    call.join(timeout=120)
    took = time.monotonic() - killed_at
    assert answers, "the agent got no answer"
    # The bound: the registry notices the death within 3 heartbeats + 1 s (2 s here), a server or
    # worker moves the turn within a second, and the turn is generated again (about 4 s).
    assert took < 20, f"the turn was answered {took:.1f} s after its worker died"
    served = _served_by(redis_client, stack.run)
    assert len(served[(session, 1)]) == 1  # one row for the turn
    assert served[(session, 1)][0] != home
    wait_until(lambda: _lane_stats(redis_client).get("moves:gone") == 1, timeout=10, what="the move counted")
    # The session's next turn goes to its new home.
    third = prompt + answers[0]["choices"][0]["token_ids"] + TOOL_RESULT
    _turn(stack.url, session, third, max_tokens=4)
    assert _served_by(redis_client, stack.run)[(session, 2)] == served[(session, 1)]


def _lane_stats(conn: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in conn.hgetall(keys.pool(None).turn_stats).items()}


def _pending_turn_id(conn: redis.Redis, session: str) -> str | None:
    in_flight = turn_ids_in_flight(conn, session)
    return in_flight[0] if in_flight else None


def test_a_weight_push_mid_episode_serves_the_next_turn_on_the_new_weights_without_the_old_cache(
        serve: Any, redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen],
        tmp_path: Path) -> None:
    import pipeline

    sim_workers("--sim-step-ms", "1", "--sim-median-tokens", "20", "--sim-p99-tokens", "21")
    _live(redis_client, 1)
    stack = serve(tokenizer=None)
    session = stack.session()
    prompt = list(range(1, 101))
    for turn in range(4):
        if turn == 2:  # the trainer pushes between the session's turns 1 and 2
            (tmp_path / "v1").mkdir()
            result = pipeline.Client(redis_client).push_weights(str(tmp_path / "v1"), version=1, timeout=60)
            assert [a.ok for a in result.acks] == [True], result
        answer = _turn(stack.url, session, prompt)
        prompt = prompt + answer["choices"][0]["token_ids"] + TOOL_RESULT
    rows = sorted(turn_rows(stack.run, redis_client).to_pylist(), key=lambda r: r["turn"])
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 1]
    # The engine's cache of the old weights is not reused for the new ones (the sim empties it at
    # a load, as SGLang's update_weights_from_disk flushes and vLLM's reload is followed by
    # /reset_prefix_cache); the turn after finds the new weights' cache again.
    assert rows[1]["cached_tokens"] > 0 and rows[2]["cached_tokens"] == 0 and rows[3]["cached_tokens"] > 0


def test_a_server_killed_mid_turn_costs_the_agent_a_retry_not_a_second_generation(
        redis_client: redis.Redis, sim_workers: Callable[..., subprocess.Popen], pipeline_env: dict[str, str],
        tmp_path: Path) -> None:
    """The openai SDK retries a connection error; the server that answers the retry (here a new one
    on the same address, as behind a load balancer) finds the turn in flight and waits for it."""
    import openai

    from tests.helpers.processes import free_port, wait_healthy

    sim_workers("--sim-step-ms", "10", "--sim-median-tokens", "300", "--sim-p99-tokens", "301")
    _live(redis_client, 1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start_server(name: str) -> subprocess.Popen:
        log = tmp_path / f"{name}.log"
        process = subprocess.Popen([*PIPELINE, "serve", "--port", str(port), "--run", "agents"], env=pipeline_env,
                                   stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_healthy(url, process, log, timeout_s=60, what=f"pipeline serve ({name})")
        return process

    first = start_server("first")
    session = httpx.post(f"{url}/sessions", json={}, timeout=30).json()["session_id"]
    client = openai.OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="unused", max_retries=6, timeout=60)
    answers: list[Any] = []
    call = threading.Thread(target=lambda: answers.append(
        client.completions.create(model="m", prompt=list(range(1, 51)), max_tokens=1000)))
    call.start()
    wait_until(lambda: _pending_turn_id(redis_client, session) is not None, timeout=30, what="the turn in flight")
    first.kill()  # SIGKILL, the turn still generating
    first.wait(timeout=10)
    second = start_server("second")
    try:
        call.join(timeout=120)
        assert answers, "the agent got no answer"
        rows = turn_rows("agents", redis_client).to_pylist()
        assert len(rows) == 1  # generated once
        assert answers[0].choices[0].token_ids == rows[0]["completion_token_ids"]
    finally:
        second.terminate()
        second.wait(timeout=20)
