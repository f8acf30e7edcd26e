"""`pipeline submit FILE.jsonl --temperature T --n N ...`: the sampling flags a dataset submit takes
are defaults for the JSONL lines that do not set them (a line's own `sampling_params` win)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from pipeline.cli.main import main
from pipeline.core.command import EXIT_USAGE
from pipeline.core.shards import read_rollouts
from pipeline.submit.request_file import parse_request_lines, with_sampling_defaults
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


def test_defaults_reach_lines_of_the_fast_parse_and_of_the_full_one_and_a_renderer_runs_once() -> None:
    lines = [json.dumps({"id": "fast", "input_ids": [1, 2]}),
             '{"id": "\\u0073low", "input_ids": [3]}',  # a \u escape: pydantic's full parse decides
             json.dumps({"id": "own", "input_ids": [4], "sampling_params": {"n": 1, "seed": 5}})]
    hook = with_sampling_defaults({"n": 3, "temperature": 0.5, "seed": 9})
    parsed = {r.id: r.to_request().sampling_params for r in parse_request_lines([line.encode() for line in lines],
                                                                                renderer=hook)}
    assert {ident: (p.n, p.temperature, p.seed) for ident, p in parsed.items()} == \
        {"fast": (3, 0.5, 9), "slow": (3, 0.5, 9), "own": (1, 0.5, 5)}

    rendered: list[str] = []

    def render(raw: str | bytes) -> dict:  # stands in for the chat renderer: prompt text to ids
        line = json.loads(raw)
        rendered.append(line["id"])
        return {"id": line["id"], "input_ids": [ord(c) for c in line.pop("prompt")], **line}

    chat = [json.dumps({"id": "c", "prompt": "hi"}), json.dumps({"id": "d\u00e9", "prompt": "yo"})]
    parsed = parse_request_lines(chat, renderer=with_sampling_defaults({"n": 2}, render))
    assert [(r.id, r.to_request().sampling_params.n) for r in parsed] == [("c", 2), ("d\u00e9", 2)]
    assert rendered == ["c", "d\u00e9"]
