"""`pipeline submit FILE.jsonl --temperature T --n N ...`: the sampling flags a dataset submit takes
are defaults for the JSONL lines that do not set them (a line's own `sampling_params` win)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from pipeline.cli.command import EXIT_USAGE
from pipeline.cli.main import main
from pipeline.read.reader import read_rollouts
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker


def test_sampling_flags_are_defaults_for_the_jsonl_lines_that_do_not_set_them(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in [
        {"id": "plain", "input_ids": [1, 2]},
        {"id": "own", "input_ids": [3], "sampling_params": {"temperature": 0.25, "n": 1}},
    ]) + "\n")
    code = main(["submit", str(path), "--redis", redis_url, "--run", "defaults", "--output", f"file://{tmp_path}",
                 "--temperature", "0.75", "--n", "3", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "requests: 2 (4 samples)" in out
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="WARNING")

    rows = read_rollouts([], "defaults", conn=redis_client, columns=["request_id", "temperature",
                                                                     "completion_token_ids"]).to_pylist()
    by_request: dict[str, list[dict]] = {}
    for row in rows:
        by_request.setdefault(row["request_id"], []).append(row)
    assert len(by_request["plain"]) == 3 and {r["temperature"] for r in by_request["plain"]} == {0.75}
    assert len(by_request["own"]) == 1 and by_request["own"][0]["temperature"] == 0.25
    assert all(len(r["completion_token_ids"]) <= 2 for r in rows)


def test_a_bad_sampling_default_for_a_jsonl_file_is_a_usage_error_naming_it(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    assert main(["submit", str(path), "--redis", redis_url, "--top-p", "7"]) == EXIT_USAGE
    assert "default sampling parameters: top_p:" in capsys.readouterr().err
    assert not redis_client.keys("pipeline:batch:*")
