"""Canceling an episode run and taking N groups of one (a real Redis and `pipeline serve`, the real
`openai` SDK, an agent worker and a rollout worker): queued episodes never start, those in flight
are stopped (their environments torn down, their turns kept out of training), the worker carries
on with other runs; `take` keeps the first N groups the filter accepts and cancels the rest."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import redis

import pipeline
from pipeline.core import agents as agent_paths
from pipeline.core.jobs import episodes
from pipeline.serve.server import Server
from pipeline.serve.sessions import SessionStore
from tests.conftest import PIPELINE
from tests.helpers.agents import events
from tests.helpers.processes import drive_worker, wait_until
from tests.workers.agents.conftest import agent
from workers.agents.worker import AgentWorker
from workers.engines.fake import FakeEngine


def _with_agent_worker(conn: redis.Redis, server: Server, name: str, concurrency: int,
                       trainer: Callable[[], None]) -> tuple[AgentWorker, bool]:
    """`trainer` run while a burst agent worker of the test agent `name` runs its episodes (in a
    thread) and a rollout worker answers their turns (in this one); the agent worker, and whether
    it was still running a minute after `trainer` returned."""
    worker = AgentWorker(conn, {agent(name): agent_paths.load(agent(name))}, serve_url=server.url,
                         concurrency=concurrency, claim_after_s=1.0)
    alive: list[bool] = []

    def drive() -> None:
        thread = threading.Thread(target=worker.work, kwargs={"burst": True})
        thread.start()
        trainer()
        thread.join(timeout=60)
        alive.append(thread.is_alive())

    drive_worker(conn, FakeEngine(), drive, stop_when_done=True)
    return worker, alive[0]


def test_a_canceled_run_stops_its_episodes_and_the_worker_goes_on(
        redis_client: redis.Redis, server: Server, events_file: Path, pipeline_env: dict[str, str]) -> None:
    client = pipeline.Client(redis_client)
    hanging = [{"id": f"h{i}", "hang": True} for i in range(4)]
    run = client.submit_episodes(hanging, agent=agent("in_sandbox"), run="doomed", n=2, timeout_s=3600)
    later = client.submit_episodes([{"id": "ok"}], agent=agent("in_sandbox"), run="later", n=2)
    seen: dict[str, object] = {}

    def trainer() -> None:
        wait_until(lambda: [e["kind"] for e in events(events_file)] == ["setup"] * 3, 60,
                   "three episodes in flight, their environments set up")
        canceled = subprocess.run([*PIPELINE, "cancel", "--run", "doomed"], env=pipeline_env, capture_output=True,
                                  text=True, timeout=60)
        seen["cli"] = (canceled.returncode, canceled.stdout, canceled.stderr)
        seen["counts"] = run.wait(timeout=30)  # every episode has its outcome at once
        later.wait(timeout=60)  # the worker stopped the canceled ones and ran the other run's

    worker, alive = _with_agent_worker(redis_client, server, "in_sandbox", 3, trainer)
    seen["alive"] = alive
    code, out, err = seen["cli"]  # type: ignore[misc]
    assert code == 0, err
    assert "canceled 8 episode(s) of run doomed that had not ended" in out
    counts = seen["counts"]
    assert counts["canceled"] == 8 and counts["finished"] == 0 and counts["submitted"] == 8  # type: ignore[index]
    assert seen["alive"] is False and worker.stats.canceled == 3
    # The three in flight had their environments torn down; the five queued never started.
    doomed = [e for e in events(events_file) if str(e.get("task", "")).startswith("h")]
    assert sorted(e["kind"] for e in doomed) == ["setup"] * 3 + ["teardown"] * 3
    # Nothing of the canceled run reaches training; their sessions are discarded; the other run trained.
    assert pipeline.read_trajectories("doomed", conn=redis_client, groups=True) == []
    assert len(episodes.discarded_sessions(redis_client, "doomed")) == 3
    assert {o.status for o in later.outcomes().values()} == {"finished"}
    assert run.counts()["running"] == 0
    status = subprocess.run([*PIPELINE, "status", "--run", "doomed"], env=pipeline_env, capture_output=True,
                            text=True, timeout=60)
    assert "8 canceled" in status.stdout


def test_take_keeps_the_first_groups_the_filter_accepts_and_cancels_the_rest(
        redis_client: redis.Redis, server: Server) -> None:
    client = pipeline.Client(redis_client)
    # Task "same" has equal rewards in its group (dropped by rewards_differ); the hanging ones never end.
    tasks = [{"id": "same", "turns": 1, "answer": 2}, {"id": "a", "turns": 1}, {"id": "b", "turns": 1},
             *({"id": f"slow{i}", "hang": True} for i in range(2))]
    run = client.submit_episodes(tasks, agent=agent("solve_or_hang"), run="over", n=2, timeout_s=3600)
    taken: dict[str, object] = {}

    def trainer() -> None:
        taken["result"] = run.take(2, keep=pipeline.rewards_differ, timeout=60)

    _with_agent_worker(redis_client, server, "solve_or_hang", 10, trainer)
    result = taken["result"]
    assert sorted(g.column("task_id")[0].as_py() for g in result.groups) == ["a", "b"]  # type: ignore[attr-defined]
    assert result.dropped == ["same"] and result.canceled == 4  # type: ignore[attr-defined]
    assert result.table.num_rows == 4  # type: ignore[attr-defined]
    counts = run.counts()
    assert counts["finished"] == 6 and counts["canceled"] == 4 and counts["running"] == 0


def test_a_canceled_episode_starts_no_turn_after_the_cancel(
        redis_client: redis.Redis, server: Server, events_file: Path) -> None:
    client = pipeline.Client(redis_client)
    # Plain function agents calling the model in a loop: their threads go on after the worker stops them.
    run = client.submit_episodes([{"id": "x"}], agent=agent("calls_until_refused"), run="stopped", n=2,
                                 timeout_s=3600)
    store = SessionStore(redis_client)
    at_cancel: dict[str, int] = {}

    def turns_of(kind: str) -> dict[str, int]:
        seen: dict[str, int] = {}
        for event in events(events_file):
            if event["kind"] == kind:
                seen[event["session"]] = seen.get(event["session"], 0) + 1
        return seen

    def trainer() -> None:
        wait_until(lambda: len(turns_of("turn")) == 2 and min(turns_of("turn").values()) >= 2, 60,
                   "two episodes calling the model")
        run.cancel()
        for session_id in turns_of("turn"):
            # The calls it started before the cancel: those committed, and those in flight (if any).
            at_cancel[session_id] = store.get(session_id).calls
        wait_until(lambda: len(turns_of("refused")) == 2, 60, "each agent's next call refused")

    worker, alive = _with_agent_worker(redis_client, server, "calls_until_refused", 2, trainer)
    assert alive is False and worker.stats.canceled == 2
    assert {e["status"] for e in events(events_file) if e["kind"] == "refused"} == {409}
    # No call started after the cancel, and each started before it was answered and recorded.
    assert {s: store.get(s).calls for s in at_cancel} == at_cancel
    assert {s: store.get(s).turns for s in at_cancel} == at_cancel
    counts = run.counts()
    assert (counts["canceled"], counts["duplicates"], counts["running"]) == (2, 0, 0)
    assert pipeline.read_trajectories("stopped", conn=redis_client).num_rows == 0
