"""`pipeline submit TASKS --agent ...` as a user types it: what it prints, and the usage errors that
enqueue nothing (bad lines, an agent that does not import, episode flags without --agent, request
flags with it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pipeline.cli.main import EXIT_USAGE, main
from pipeline.core.broker import keys
from pipeline.core.jobs import episodes

AGENT = "tests.helpers.agents:solve"


def _cli(capsys: pytest.CaptureFixture[str], redis_url: str, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--redis", redis_url])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_with_an_agent_enqueues_an_episode_per_task_and_sample(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "prompt": [1, 2]}\n\n{"prompt": [3]}\n')
    code, out, err = _cli(capsys, redis_url, "submit", str(tasks), "--agent", AGENT, "--n", "4", "--run", "cli-ep",
                          "--max-turns", "6", "--retries", "1")
    assert code == 0, err
    assert out.splitlines() == ["run: cli-ep (pool default)", f"episodes: 8 (2 tasks x 4) for agent {AGENT}",
                                f"run them: pipeline agent-worker --agent {AGENT}"]
    info = episodes.run_info(redis_client, "cli-ep")
    assert info is not None and info["tasks"] == ["a", "L3"] and info["limits"]["max_turns"] == 6
    assert info["counts"]["queued"] == 8
    assert redis_client.xlen(keys.pool(None).episode_stream(AGENT)) == 8


@pytest.mark.parametrize(("argv", "message"), [
    (["--agent", "tests.helpers.nope:solve"], "agent 'tests.helpers.nope:solve': no module named 'tests.helpers.nope'"),
    (["--agent", "solve"], "agent 'solve' is not package.module:function"),
    (["--episode-timeout", "5"], "--episode-timeout apply to agent episodes: add --agent MODULE:FUNCTION"),
    (["--agent", AGENT, "--temperature", "0.5"], "--temperature do not apply to agent episodes"),
    (["--agent", AGENT, "--max-staleness", "1"], "--max-staleness K needs --groups-per-step B"),
    (["--adapter", "sql"], "--adapter apply to agent episodes: add --agent MODULE:FUNCTION"),
    (["--agent", AGENT, "--adapter", "sql"], "--adapter sql: adapter 'sql' was never pushed to pool 'default'"),
])
def test_a_wrong_episode_submit_is_a_usage_error_and_enqueues_nothing(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n')
    code, _, err = _cli(capsys, redis_url, "submit", str(tasks), "--run", "wrong", *argv)
    assert code == EXIT_USAGE and message in err, err
    assert episodes.run_info(redis_client, "wrong") is None


def test_bad_task_lines_are_listed_with_their_line_and_nothing_is_enqueued(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n"just a string"\n{"id": "a b"}\n')
    code, _, err = _cli(capsys, redis_url, "submit", str(tasks), "--agent", AGENT, "--run", "bad-lines")
    assert code == EXIT_USAGE
    assert "tasks.jsonl: 2 invalid line(s); nothing was enqueued" in err
    assert "tasks.jsonl:2: a task is a JSON object, not str" in err
    assert "tasks.jsonl:3: id: 'a b' is not a task id" in err
    assert episodes.run_info(redis_client, "bad-lines") is None
