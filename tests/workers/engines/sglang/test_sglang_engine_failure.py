"""An SGLang server that dies under a worker: the worker hands its job back, shows itself
unhealthy, takes nothing while the server is down, and recovers when it is back."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pipeline
from pipeline.core.broker import registry
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, wait_until
from tests.workers.engines.conftest import launch, stop, wait_ready


def test_worker_survives_its_server_dying(
    tmp_path: Path, redis_url: str, pipeline_env: dict[str, str], tiny_model_dir: Path
) -> None:
    port = free_port()
    server = launch(tiny_model_dir, tmp_path / "standin-1.log", port=port)
    wait_ready(server)
    worker = subprocess.Popen(
        [*PIPELINE, "worker", "--engine", "sglang-http", "--url", server.url, "--health-probe-max", "1",
         "--log-level", "WARNING"],
        env=pipeline_env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "worker.log").open("wb"),
    )
    client = pipeline.connect(redis_url)
    try:
        wait_until(lambda: [w.state for w in registry.live_workers(client.conn)] == ["idle"], 60, "an idle worker")
        first = client.submit([{"id": "warm", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}],
                              run="before", output=f"file://{tmp_path}")
        first.wait(timeout=60)

        stop(server)  # the engine dies
        batch = client.submit(
            [{"id": f"q{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "seed": i}}
             for i in range(4)],
            run="during", output=f"file://{tmp_path}",
        )
        wait_until(lambda: [w.state for w in registry.live_workers(client.conn)] == ["unhealthy"], 60,
               "the worker unhealthy")
        [entry] = registry.live_workers(client.conn)
        assert entry.error and "engine failed" in entry.error
        time.sleep(2)
        # Handed back, not failed: the job waits in the queue, no retry spent, no shard.
        assert batch.status().counts["queued"] == 1 and batch.status().counts["failed"] == 0, batch.job_states()
        assert not (tmp_path / "during").exists()

        server = launch(tiny_model_dir, tmp_path / "standin-2.log", port=port)  # the engine is back
        wait_ready(server)
        batch.wait(timeout=90)
        assert batch.read().num_rows == 4
        wait_until(lambda: [w.state for w in registry.live_workers(client.conn)] == ["idle"], 30, "the worker healthy")
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        stop(server)
