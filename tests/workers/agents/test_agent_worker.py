"""Agent episodes end to end in one process: tasks submitted as episode jobs, an agent worker running
them against a real `pipeline serve` with the real `openai` SDK, a rollout worker answering the turns,
and the groups of trajectories a GRPO trainer reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.core.broker import keys
from pipeline.core.errors import AgentImportError, RequestFileError
from pipeline.core.jobs import episodes
from pipeline.read.lineage_rows import turn_rows
from pipeline.serve.server import Server
from tests.helpers.agents import TOOL_RESULT, events
from tests.workers.agents.conftest import agent, run_episodes

TASKS = [{"id": "add-1", "prompt": [5, 6, 7], "turns": 2, "answer": 0},
         {"prompt": [8, 9], "turns": 3, "answer": 1},
         {"id": 17, "prompt": [4], "turns": 1, "answer": 0}]


def _submit(conn: redis.Redis, name: str, tasks: list[dict] | None = None, **options: object) -> pipeline.Client:
    client = pipeline.Client(conn)
    return client.submit_episodes(tasks or TASKS, agent=agent(name), run=options.pop("run", "ep"), **options)


def test_each_task_sample_is_one_exact_trajectory_and_a_task_one_group(redis_client: redis.Redis,
                                                                       server: Server) -> None:
    run = _submit(redis_client, "solve", n=2)
    assert run.counts()["queued"] == 6
    stats = run_episodes(redis_client, server, "solve")
    assert (stats.finished, stats.failed, stats.retried) == (6, 0, 0)
    assert run.counts() | {} == {"submitted": 6, "finished": 6, "failed": 0, "canceled": 0, "retried": 0,
                                 "abandoned": 0, "handed_back": 0, "duplicates": 0, "running": 0, "queued": 0}

    groups = pipeline.read_trajectories("ep", conn=redis_client, groups=True)
    assert [g.column("task_id").to_pylist() for g in groups] == [["add-1"] * 2, ["1"] * 2, ["17"] * 2]
    for task, group in zip(TASKS, groups, strict=True):
        rows = group.to_pylist()
        assert [r["sample"] for r in rows] == [0, 1]
        assert [r["reward"] for r in rows] == [1.0 if s % 2 == task["answer"] else 0.0 for s in (0, 1)]
        for row in rows:
            # The fake engine answers sample 0 of every turn with four 1s: prompt, then per turn the
            # sampled ids (mask 1, version 0) and the tool result the agent appended (mask 0).
            turn = [1, 1, 1, 1]
            expected = task["prompt"] + (turn + TOOL_RESULT) * (task["turns"] - 1) + turn
            assert row["input_ids"] == expected
            start = len(task["prompt"])
            sampled = [p for t in range(task["turns"]) for p in range(start + t * 7, start + t * 7 + 4)]
            assert [p for p, m in enumerate(row["loss_mask"]) if m] == sampled
            assert {row["token_weight_version"][p] for p in sampled} == {0}
            assert (row["status"], row["attempts"], row["episode_turns"]) == ("finished", 1, task["turns"])
            assert json.loads(row["info"]) == {"tokens": len(expected) + len(TOOL_RESULT)}
            session = redis_client.hgetall(keys.session(row["session_id"]))
            assert json.loads(session[b"metadata"])["trace_id"] == row["trace_id"]
            assert json.loads(session[b"reward"]) == {"reward": row["reward"]}
            assert session[b"state"] == b"ended"
    assert len({r["session_id"] for g in groups for r in g.to_pylist()}) == 6


def test_a_failed_attempt_is_retried_in_a_fresh_session_whose_turns_never_reach_training(
        redis_client: redis.Redis, server: Server) -> None:
    run = _submit(redis_client, "flaky", TASKS[:2])
    stats = run_episodes(redis_client, server, "flaky")
    assert (stats.finished, stats.retried) == (2, 2)
    assert run.counts()["retried"] == 2 and run.counts()["finished"] == 2
    outcomes = run.outcomes()
    assert {o.attempts for o in outcomes.values()} == {2}
    discarded = episodes.discarded_sessions(redis_client, "ep")
    assert len(discarded) == 2 and not discarded & {o.session_id for o in outcomes.values()}
    # The first attempts' turns were served and logged (visible), but no trajectory holds them.
    served = {r["session_id"] for r in turn_rows("ep", redis_client).to_pylist()}
    assert discarded <= served
    read = run.trajectories()
    assert set(read.column("session_id").to_pylist()) == {o.session_id for o in outcomes.values()}


@pytest.mark.parametrize(("name", "options", "reason", "attempts"), [
    ("hangs", {"timeout_s": 1.0, "retries": 1}, "timed out after 1 s (--episode-timeout)", 2),
    ("bad_reward", {}, "the agent returned 'five' (str) as its reward", 1),
    ("silent", {}, "the agent returned without calling the model", 1),
    ("rejects", {"retries": 1}, "the agent raised KeyError: \"task 'add-1' has no 'question'\"", 2),
    ("loops", {"max_turns": 3}, "the agent went on past 3 model calls (--max-turns)", 1),
])
def test_an_episode_that_cannot_finish_fails_with_its_reason(redis_client: redis.Redis, server: Server, name: str,
                                                              options: dict, reason: str, attempts: int) -> None:
    run = _submit(redis_client, name, TASKS[:1], **options)
    run_episodes(redis_client, server, name)
    (outcome,) = run.outcomes().values()
    assert outcome.status == "failed" and outcome.reason is not None and outcome.reason.startswith(reason)
    assert outcome.attempts == attempts
    assert run.groups() is not None and list(run.groups()) == []  # failed episodes are left out of training
    assert run.trajectories().num_rows == 0


def test_failed_episodes_train_with_the_failed_reward_when_asked(redis_client: redis.Redis, server: Server) -> None:
    run = _submit(redis_client, "bad_reward", TASKS[:1], n=2, failed_reward=0.0)
    run_episodes(redis_client, server, "bad_reward")
    (group,) = run.groups()
    assert group.column("status").to_pylist() == ["failed", "failed"]
    assert group.column("reward").to_pylist() == [0.0, 0.0]
    assert all(len(ids) == 4 + 3 for ids in group.column("input_ids").to_pylist())  # the one turn it made


def test_an_agent_stopped_at_max_turns_that_returns_a_reward_is_truncated(redis_client: redis.Redis,
                                                                          server: Server) -> None:
    run = _submit(redis_client, "loops_then_scores", TASKS[:1], max_turns=2)
    run_episodes(redis_client, server, "loops_then_scores")
    (outcome,) = run.outcomes().values()
    assert (outcome.status, outcome.reward, outcome.turns, outcome.info) == ("finished", 0.5, 2, {"truncated": True})


def test_the_environment_is_torn_down_however_the_episode_ends(redis_client: redis.Redis, server: Server,
                                                              events_file: Path) -> None:
    tasks = [{"id": "ok"}, {"id": "fails", "fail": True}, {"id": "hangs", "hang": True}]
    run = _submit(redis_client, "in_sandbox", tasks, timeout_s=1.0, retries=1)
    run_episodes(redis_client, server, "in_sandbox")
    outcomes = run.outcomes()
    assert {k: o.status for k, o in outcomes.items()} == {"ok:0": "finished", "fails:0": "failed",
                                                          "hangs:0": "failed"}
    seen = events(events_file)
    for task, attempts in (("ok", 1), ("fails", 2), ("hangs", 2)):
        mine = [e["kind"] for e in seen if e.get("task") == task]
        assert mine == ["setup", "teardown"] * attempts, (task, mine)


def test_a_plain_function_agent_gets_a_sync_client(redis_client: redis.Redis, server: Server) -> None:
    run = _submit(redis_client, "solve_sync", TASKS[:1])
    run_episodes(redis_client, server, "solve_sync")
    (outcome,) = run.outcomes().values()
    assert (outcome.status, outcome.turns) == ("finished", 2)


def test_a_submit_is_all_or_nothing(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n[1, 2]\n{"id": "a"}\nnot json\n{"id": {"x": 1}}\n')
    with pytest.raises(RequestFileError) as caught:
        client.submit_episodes(str(tasks), agent=agent("solve"), run="bad")
    message = str(caught.value)
    for fragment in ("tasks.jsonl:2: a task is a JSON object, not list",
                     "tasks.jsonl:3: id: 'a' is also the id of line 1", "tasks.jsonl:4: not JSON",
                     "tasks.jsonl:5: id: {'x': 1} is not a task id", "nothing was enqueued"):
        assert fragment in message
    with pytest.raises(AgentImportError, match=r"no module named 'tests\.helpers\.agentz'"):
        client.submit_episodes([{"id": "a"}], agent="tests.helpers.agentz:solve", run="bad")
    with pytest.raises(AgentImportError, match="has no attribute 'solv'"):
        client.submit_episodes([{"id": "a"}], agent=agent("solv"), run="bad")
    assert episodes.run_info(redis_client, "bad") is None
    assert not redis_client.exists(keys.pool(None).episode_stream(agent("solve")))

    client.submit_episodes([{"id": "a"}], agent=agent("solve"), run="once")
    with pytest.raises(pipeline.PipelineError, match="run 'once' already has 1 of these request ids"):
        client.submit_episodes([{"id": "b"}, {"id": "a"}], agent=agent("solve"), run="once")
    assert episodes.run_info(redis_client, "once")["counts"]["submitted"] == 1
    assert redis_client.xlen(keys.pool(None).episode_stream(agent("solve"))) == 1


def test_an_episode_over_the_staleness_budget_waits_for_the_trainers_next_version(
        redis_client: redis.Redis, server: Server) -> None:
    import threading
    import time

    from pipeline.core import agents as agent_paths
    from tests.helpers.processes import drive_worker, wait_until
    from workers.agents.worker import AgentWorker
    from workers.engines.fake import FakeEngine

    client = pipeline.Client(redis_client)
    run = client.submit_episodes([{"id": "step0"}, {"id": "step1"}], agent=agent("solve"), run="ep",
                                 max_staleness=0, groups_per_step=1)
    seen: dict[str, object] = {}

    def trainer() -> None:
        worker = AgentWorker(redis_client, {agent("solve"): agent_paths.load(agent("solve"))}, serve_url=server.url)
        thread = threading.Thread(target=worker.work, kwargs={"burst": True})
        thread.start()
        wait_until(lambda: "step0:0" in run.outcomes(), 60, "step 0's episode")
        seen["before"] = (sorted(run.outcomes()), run.counts()["running"])
        seen["pushed_ms"] = int(time.time() * 1000)
        client.push_weights("/ckpt/v1", version=1, timeout=30)
        thread.join(timeout=60)

    drive_worker(redis_client, FakeEngine(), trainer, stop_when_done=True)
    assert seen["before"] == (["step0:0"], 0)  # step 1's episode waited, not started, while v0 was the latest
    outcomes = run.outcomes()
    assert outcomes["step1:0"].status == "finished" and outcomes["step1:0"].started_at_ms >= seen["pushed_ms"]
    versions = {row["task_id"]: set(row["token_weight_version"]) - {-1} for row in run.trajectories().to_pylist()}
    assert versions == {"step0": {0}, "step1": {1}}


def test_status_shows_a_runs_episodes_and_the_reasons_they_failed(redis_client: redis.Redis, server: Server,
                                                                   pipeline_env: dict[str, str]) -> None:
    import subprocess

    from tests.conftest import PIPELINE

    _submit(redis_client, "rejects", [{"id": "a", "question": "?"}, {"id": "b"}], n=2, retries=1)
    run_episodes(redis_client, server, "rejects")
    done = subprocess.run([*PIPELINE, "status"], env=pipeline_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("episodes (2 tasks x 2, agent tests.helpers.agents:rejects): 0 queued, 0 running, 2 finished, 2 failed; "
            "2 retried, 0 abandoned by a worker that died, 0 handed back by a worker shutting down") in done.stdout
    assert "failed x2: the agent raised KeyError: \"task 'b' has no 'question'\"" in done.stdout


def test_the_report_has_an_episodes_section(redis_client: redis.Redis, server: Server) -> None:
    from tests.pipeline.audit.test_report import Page, assert_self_contained
    from workers.jobs.turn_commits import flush_turns

    _submit(redis_client, "rejects", [{"id": "a", "question": "?", "turns": 2}, {"id": "b"}], n=2, retries=1)
    run_episodes(redis_client, server, "rejects")
    flush_turns(redis_client, "ep", force=True)  # any turn still in the log into a shard, as the flusher would
    page = Page(pipeline.report("ep", conn=redis_client))
    assert "Agent episodes" in page.titles
    (overview,) = page.table_with("abandoned")
    assert (overview["episodes"], overview["finished"], overview["failed"], overview["retried"]) == ("4", "2", "2", "2")
    assert page.table_with("turns") == [{"turns": "2", "finished episodes": "2", "mean reward": "1"}]
    # Every episode took 2 turns: the plot is the reward distribution and the reward over the run, not
    # one bar of reward by turns; their tables say the same.
    assert page.table_with("reward") == [{"reward": "1", "finished episodes": "2"}]
    over_run = page.table_with("ended (tenth of the run)")
    assert sum(int(r["finished episodes"]) for r in over_run) == 2 and {r["mean reward"] for r in over_run} == {"1"}
    assert_self_contained(page)
    (failed,) = page.table_with("reason")
    assert failed == {"failed": "2", "reason": "the agent raised KeyError: \"task 'b' has no 'question'\""}
