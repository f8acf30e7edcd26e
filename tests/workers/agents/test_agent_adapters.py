"""LoRA adapters for agents, through a real `pipeline serve` and the sim engine: a session opened
naming an adapter runs every turn on it (rows recording adapter and version; a base session's turns
on the base), an episode run submitted with `adapter` opens its sessions on it; an adapter the pool
never had is refused at session creation and at submit, naming the adapters there are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow as pa
import pytest
import redis

import pipeline
from pipeline.core.errors import AdapterError
from pipeline.core.jobs import episodes, turn_log
from pipeline.core.shards import read_rollouts
from pipeline.serve.server import Server
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import drive_worker
from tests.workers.agents.conftest import agent, run_episodes
from workers.engines.sim.engine import SimConfig, SimEngine

PROMPT = [5, 6, 7]


@pytest.fixture
def client(redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           tiny_model_dir: Path) -> pipeline.Client:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    client = pipeline.Client(redis_client)
    for name, seed in (("sql", 1), ("math", 2)):
        client.push_adapter(name, build_adapter(tiny_model_dir, tmp_path / name, seed=seed), base=tiny_model_dir)
    return client


def _sim() -> SimEngine:
    return SimEngine(SimConfig(median_tokens=4, p99_tokens=5))


def _turns(conn: redis.Redis, run: str) -> dict[str, list[dict[str, Any]]]:
    """Each session's turn rows (its shards and its turn log), all their columns."""
    columns = ["session_id", "turn", "adapter", "adapter_version", "completion_token_ids"]
    tables = [read_rollouts([], run=run, conn=conn, missing_ok=True), *turn_log.unflushed(conn, run)]
    rows = pa.concat_tables([t.select(columns) for t in tables if "session_id" in t.column_names],
                            promote_options="permissive").to_pylist()
    sessions: dict[str, list[dict[str, Any]]] = {}
    for row in sorted({(r["session_id"], r["turn"]): r for r in rows}.values(),
                      key=lambda r: (r["session_id"], r["turn"])):
        sessions.setdefault(row["session_id"], []).append(row)
    return sessions


def test_every_turn_of_a_session_runs_on_its_adapter(client: pipeline.Client, redis_client: redis.Redis,
                                                      server: Server) -> None:
    opened = {name: httpx.post(f"{server.url}/sessions", json={"adapter": name} if name else {}, timeout=30).json()
              for name in ("sql", None)}
    assert opened["sql"]["adapter"] == "sql" and opened[None]["adapter"] is None
    assert httpx.get(f"{server.url}/sessions/{opened['sql']['session_id']}", timeout=30).json()["adapter"] == "sql"

    def agent_calls() -> None:
        for session in opened.values():
            chat = openai.OpenAI(base_url=f"{server.url}/sessions/{session['session_id']}/v1", api_key="unused",
                                 max_retries=0)
            prompt = list(PROMPT)
            for _ in range(2):
                answer = chat.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
                prompt += [*answer.choices[0].token_ids, 3]  # type: ignore[attr-defined]

    drive_worker(redis_client, _sim(), agent_calls, stop_when_done=True)
    sessions = _turns(redis_client, "agents-default")
    on_sql, on_base = sessions[opened["sql"]["session_id"]], sessions[opened[None]["session_id"]]
    assert [(r["turn"], r["adapter"], r["adapter_version"]) for r in on_sql] == [(0, "sql", 1), (1, "sql", 1)]
    assert [(r["adapter"], r["adapter_version"]) for r in on_base] == [(None, None), (None, None)]
    assert on_sql[0]["completion_token_ids"] != on_base[0]["completion_token_ids"]  # same prompt, its own draws
    # What a trainer reads: each lineage says its adapter, and each sampled token the version that sampled it.
    lineages = {item["session_id"]: item for item in pipeline.read_trajectories("agents-default",
                                                                               conn=redis_client).to_pylist()}
    sql, base = lineages[opened["sql"]["session_id"]], lineages[opened[None]["session_id"]]
    assert sql["adapter"] == "sql" and base["adapter"] is None
    assert sql["token_adapter_version"] == [1 if m else -1 for m in sql["loss_mask"]]
    assert set(base["token_adapter_version"]) == {-1}
    batch = next(iter(pipeline.RolloutBatches("agents-default", conn=redis_client, trajectories=True,
                                              batch_size=2)))
    row = batch["session_id"].index(opened["sql"]["session_id"])
    assert batch["adapter"][row] == "sql"
    assert batch["token_adapter_version"][row][:len(sql["input_ids"])].tolist() == sql["token_adapter_version"]


def test_a_session_naming_an_unknown_adapter_is_refused_with_the_names_there_are(
        client: pipeline.Client, server: Server) -> None:
    answer = httpx.post(f"{server.url}/sessions", json={"adapter": "sqll"}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "adapter"
    assert "adapter 'sqll' was never pushed to pool 'default'" in error["message"]
    assert "'sql'" in error["message"] and "math" in error["message"]


def test_an_episode_run_with_an_adapter_runs_every_turn_on_it(client: pipeline.Client, redis_client: redis.Redis,
                                                               server: Server) -> None:
    tasks = [{"id": "t", "prompt": PROMPT, "turns": 2}]
    client.submit_episodes(tasks, agent=agent("solve"), run="ep-sql", n=2, adapter="sql")
    stats = run_episodes(redis_client, server, "solve", engine=_sim())
    assert (stats.finished, stats.failed) == (2, 0)
    sessions = _turns(redis_client, "ep-sql")
    assert len(sessions) == 2
    assert {(r["adapter"], r["adapter_version"]) for rows in sessions.values() for r in rows} == {("sql", 1)}
    assert sorted(len(rows) for rows in sessions.values()) == [2, 2]


def test_an_episode_run_naming_an_unknown_adapter_is_refused_and_nothing_enqueued(
        client: pipeline.Client, redis_client: redis.Redis) -> None:
    with pytest.raises(AdapterError, match=r"--adapter sqll: adapter 'sqll' was never pushed .*'sql'") as refused:
        client.submit_episodes([{"id": "t"}], agent=agent("solve"), run="ep-bad", adapter="sqll")
    assert "nothing was enqueued" in str(refused.value) and "math" in str(refused.value)
    assert not episodes.is_episode_run(redis_client, "ep-bad")
