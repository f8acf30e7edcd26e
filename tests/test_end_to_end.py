"""The whole loop over a real redis-server and a separate worker process.

JSONL of 50 requests (n > 1 for some) → `pipeline submit --wait` → `pipeline worker` →
Parquet shards → read back.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeline
from tests.conftest import PIPELINE
from tests.helpers.invariants import assert_row_invariants


def make_requests(count: int = 50) -> list[dict]:
    lines = []
    for i in range(count):
        lines.append({
            "id": f"q{i}",
            "input_ids": [(i * 7 + k) % 68 + 1 for k in range(3 + i % 5)],
            "sampling_params": {"max_new_tokens": 6 + i % 4, "temperature": 0.8 if i % 3 else 0.0,
                                "top_p": 0.9, "n": 3 if i % 5 == 0 else 1, "seed": 100 + i},
            "logprobs": 0,
            "prompt_logprobs": 0 if i % 7 == 0 else None,
            "metadata": {"group": f"g{i % 4}", "answer": str(i)},
        })
    return lines


@pytest.fixture
def worker(start_worker: Callable[..., subprocess.Popen]) -> subprocess.Popen:
    return start_worker()


def submit(env: dict[str, str], path: Path, run: str, output: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PIPELINE, "submit", str(path), "--run", run, "--output", output, "--batch-size", "8", "--wait",
         "--timeout", "180", *extra],
        env=env, capture_output=True, text=True, timeout=240,
    )


def test_fifty_requests_through_a_worker_process(
    tmp_path: Path, pipeline_env: dict[str, str], redis_url: str, worker: subprocess.Popen
) -> None:
    lines = make_requests()
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = f"file://{tmp_path / 'shards'}"

    first = submit(pipeline_env, path, "e2e-a", output)
    assert first.returncode == 0, first.stderr + first.stdout
    assert "requests: 50 (70 samples) in 7 jobs" in first.stdout
    assert "done: 7 jobs, 70 rows" in first.stdout
    second = submit(pipeline_env, path, "e2e-b", output)
    assert second.returncode == 0, second.stderr

    table = pipeline.read_rollouts(output, "e2e-a")
    rows = table.to_pylist()
    by_id = {line["id"]: line for line in lines}
    assert len(rows) == sum(line["sampling_params"]["n"] for line in lines)
    assert len({r["rollout_id"] for r in rows}) == len(rows)
    for row in rows:
        assert_row_invariants(row, by_id[row["request_id"]])
        assert row["run"] == "e2e-a" and row["engine"] == "hf" and row["weight_version"] == 0
        assert row["completion_text"] is not None
        assert row["started_at"] <= row["finished_at"]
        wants_prompt = by_id[row["request_id"]]["prompt_logprobs"] is not None
        assert (row["prompt_logprobs"] is not None) == wants_prompt
    samples = {r["request_id"]: sorted(x["sample_index"] for x in rows if x["request_id"] == r["request_id"])
               for r in rows}
    assert samples["q0"] == [0, 1, 2] and samples["q1"] == [0]

    # The same seeds give the same tokens in another run.
    again = {r["rollout_id"]: r["completion_token_ids"] for r in pipeline.read_rollouts(output, "e2e-b").to_pylist()}
    assert again == {r["rollout_id"]: r["completion_token_ids"] for r in rows}

    # Shards: one per job; the commit log agrees; `pipeline show` renders them.
    shards = sorted((tmp_path / "shards" / "e2e-a").iterdir())
    assert len(shards) == 7 and all(p.suffix == ".parquet" for p in shards)
    client = pipeline.connect(redis_url)
    status = subprocess.run([*PIPELINE, "status", "--json"], env=pipeline_env, capture_output=True, text=True,
                            check=True)
    default = json.loads(status.stdout)["pools"]["default"]
    runs = default["runs"]
    assert runs["e2e-a"]["shards"] == 7 and runs["e2e-a"]["rows"] == 70
    assert [w["state"] for w in default["workers"]] == ["idle"]
    shown = subprocess.run([*PIPELINE, "show", f"{output}/e2e-a", "--limit", "2", "--token-ids"],
                           env=pipeline_env, capture_output=True, text=True, check=True)
    assert "token_id:" in shown.stdout and "finish=" in shown.stdout

    # A live worker without top-k allowed: submit refuses such a request before enqueueing.
    with pytest.raises(pipeline.CapabilityError, match="top-2 logprobs"):
        client.submit([{**lines[1], "logprobs": 2}], run="e2e-c", output=output)


def test_failed_jobs_make_wait_exit_non_zero(
    tmp_path: Path, pipeline_env: dict[str, str], worker: subprocess.Popen
) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in make_requests(3)))
    # A file where the run's directory should go: the shard write fails, the job fails
    # (after its retries), and `--wait` names it.
    (tmp_path / "blocked-run").write_text("x")
    failing = submit(pipeline_env, path, "blocked-run", f"file://{tmp_path}")
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "1 job(s) failed" in failing.stderr
    assert "could not write shard" in failing.stderr
