"""Shards on S3: a worker process writes to a real S3-compatible server (moto's server mode).

Credentials and endpoint come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL), as on a cluster with MinIO.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pipeline
from pipeline.core.broker import commit_log
from tests.conftest import PIPELINE
from tests.helpers.invariants import assert_row_invariants
from tests.helpers.processes import free_port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert server, "moto[server] is a test dependency"
    port = free_port()
    process = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    yield endpoint
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint: str, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    creds = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_ENDPOINT_URL": s3_endpoint}
    for key, value in creds.items():
        monkeypatch.setenv(key, value)
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="rollouts")
    import fsspec

    fsspec.filesystem("s3").invalidate_cache()
    return {**pipeline_env, **creds}


def test_worker_writes_shards_to_s3_and_commits_them(
    tmp_path: Path, s3_env: dict[str, str], redis_url: str, tiny_model_dir: Path
) -> None:
    lines = [{"id": f"q{i}", "input_ids": [1 + i, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2, "seed": i}}
             for i in range(6)]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    submitted = subprocess.run(
        [*PIPELINE, "submit", str(path), "--run", "s3run", "--output", "s3://rollouts/prefix", "--batch-size", "4"],
        env=s3_env, capture_output=True, text=True, check=True,
    )
    assert "output: s3://rollouts/prefix/s3run" in submitted.stdout
    subprocess.run([*PIPELINE, "worker", "--model", str(tiny_model_dir), "--burst", "--log-level", "WARNING"],
                   env=s3_env, capture_output=True, text=True, check=True, timeout=180)

    import boto3

    objects = boto3.client("s3").list_objects_v2(Bucket="rollouts", Prefix="prefix/")["Contents"]
    keys = sorted(o["Key"] for o in objects)
    # One object per job, nothing temporary left behind.
    assert len(keys) == 2 and all(k.startswith("prefix/s3run/") and k.endswith(".parquet") for k in keys)
    client = pipeline.connect(redis_url)
    commits = commit_log.read_all(client.conn, "s3run")
    assert sorted(c.url for c in commits) == sorted(f"s3://rollouts/{k}" for k in keys)
    table = pipeline.read_rollouts("s3://rollouts/prefix", "s3run")
    assert table.num_rows == 12
    by_id = {line["id"]: line for line in lines}
    for row in table.to_pylist():
        assert_row_invariants(row, by_id[row["request_id"]])
