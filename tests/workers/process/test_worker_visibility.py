"""A worker is easy to find and its log easy to read: `ps` names it `pipeline worker (pool, engine,
model)`, RQ's periodic group-registry cleaning is DEBUG, and no tqdm bar lands in a log file."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import redis

from pipeline.core.broker import registry
from tests.conftest import PIPELINE
from tests.helpers.processes import terminate, wait_until
from workers.engines.fake import FakeEngine
from workers.process.worker import RolloutWorker


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_a_worker_process_is_titled_pipeline_worker_with_its_pool_engine_and_model_and_logs_no_bars(
        pipeline_env: dict[str, str], redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with open(log, "w") as stream:
        process = subprocess.Popen([*PIPELINE, "worker", "--model", str(tiny_model_dir), "--pool", "finder",
                                    "--log-level", "INFO"], env=pipeline_env, stdout=stream, stderr=stream)
    try:
        wait_until(lambda: bool(registry.live_workers(redis_client, "finder")), timeout=120,
                   what="the worker to register")
        wait_until(lambda: "Listening" in _title(process.pid), timeout=60, what="the worker to listen")
        title = _title(process.pid)
    finally:
        terminate(process, timeout=30)
    # The model was loaded with stderr a file: no progress bar (transformers' "Loading weights") in it.
    text = log.read_text()
    assert "Loading weights" not in text and "\r" not in text, text[-2000:]
    assert title.startswith(f"pipeline worker (finder, hf, {tiny_model_dir}): Listening on "), title
    assert "rq:worker" not in title


def test_rq_group_registry_cleaning_is_logged_at_debug_not_info(
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    worker = RolloutWorker(redis_client, FakeEngine())
    with caplog.at_level(logging.DEBUG):
        worker.clean_group_registries()
    cleaning = [r for r in caplog.records if "group registries" in r.getMessage()]
    assert [r.levelno for r in cleaning] == [logging.DEBUG]
