"""Request ids are unique within a run (a row's `rollout_id` is `{request id}:{sample}`): a submit
naming an id the run already has is refused whole, naming the run and the ids; on a real Redis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.cli.main import main as cli_main
from pipeline.core.jobs.queue import rollout_queue


def _lines(ids: list[str]) -> str:
    return "".join(json.dumps({"id": i, "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}) + "\n"
                   for i in ids)


def test_the_same_file_submitted_twice_into_one_run_is_refused(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(_lines(["a", "b", "c"]))
    submit = ["submit", str(path), "--redis", redis_url, "--output", "memory://x", "--run", "twice"]
    assert cli_main(submit) == 0, capsys.readouterr().err
    capsys.readouterr()

    assert cli_main(submit) == 2
    err = capsys.readouterr().err
    assert "run 'twice' already has 3 of these request ids ('a', 'b', 'c')" in err, err
    assert "--run" in err and "nothing was enqueued" in err
    assert rollout_queue(redis_client).count == 1  # the first submit's job only

    # New ids go into the same run; the same ids into another run.
    path.write_text(_lines(["d"]))
    assert cli_main(submit) == 0, capsys.readouterr().err
    path.write_text(_lines(["a", "b", "c"]))
    assert cli_main([*submit[:-1], "other"]) == 0, capsys.readouterr().err


def test_an_overlap_in_a_table_submit_is_refused_whole(redis_url: str, redis_client: redis.Redis) -> None:
    import pyarrow as pa

    odd = 'q "2"\n\u00e9'  # quotes, a newline, a non-ASCII letter: ids of any text
    client = pipeline.connect(redis_url)
    client.submit(pa.table({"id": ["q1", odd], "input_ids": [[1], [2]]}), run="t", output="memory://x")
    with pytest.raises(pipeline.PipelineError) as refused:
        client.submit(pa.table({"id": [odd, "q3"], "input_ids": [[1], [2]]}), run="t", output="memory://x")
    assert f"run 't' already has 1 of these request ids ({odd!r})" in str(refused.value)
    assert rollout_queue(redis_client).count == 1
    client.submit(pa.table({"id": ["q3"], "input_ids": [[3]]}), run="t", output="memory://x")
    assert rollout_queue(redis_client).count == 2


def test_many_taken_ids_are_counted_and_the_first_ten_named(redis_url: str) -> None:
    rows = [{"id": f"r{i:02d}", "input_ids": [1]} for i in range(25)]
    client = pipeline.connect(redis_url)
    client.submit(rows, run="many", output="memory://x")
    with pytest.raises(pipeline.PipelineError, match=r"already has 25 of these request ids \('r00', 'r01', .*'r09' "
                                                     r"and 15 more\)"):
        client.submit(rows[::-1], run="many", output="memory://x")
