"""Weight pushes against real worker processes in the two hard moments: while a batch runs,
and across a Redis restart between the push and the acknowledgements.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pipeline
from pipeline.core.broker import control_channel, registry
from pipeline.core.broker.connection import connect_redis
from pipeline.core.broker.redis_server import RedisServer
from tests.helpers.processes import free_port, wait_until

LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 160, "ignore_eos": True, "seed": 1}}


def test_push_while_a_batch_runs_lands_between_batches(
    redis_url: str, start_worker: Callable[..., subprocess.Popen], v1_model_dir: Path, tmp_path: Path
) -> None:
    client = pipeline.connect(redis_url)
    start_worker()
    wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 60, "an idle worker")
    running = client.submit([{**LONG, "id": f"long{i}"} for i in range(6)], run="during", output=f"file://{tmp_path}")
    wait_until(lambda: [w.state for w in client.workers()] == ["busy"], 30, "the worker busy with the batch")

    pushed = client.push_weights(str(v1_model_dir), version=1, timeout=120)
    acked_at = time.time()
    assert [(a.version, a.ok) for a in pushed.acks] == [(1, True)]
    running.wait(timeout=60)
    before = running.read()
    # The batch in hand finished on v0, entirely, before the new weights were acknowledged.
    assert set(before.column("weight_version").to_pylist()) == {0}
    assert max(t.timestamp() for t in before.column("finished_at").to_pylist()) <= acked_at

    after = client.submit([{**LONG, "id": "next"}], run="after", output=f"file://{tmp_path}")
    after.wait(timeout=60)
    assert after.read().column("weight_version").to_pylist() == [1]


def test_redis_restart_between_push_and_ack_still_converges(
    tmp_path: Path, start_worker: Callable[..., subprocess.Popen], v1_model_dir: Path
) -> None:
    server = RedisServer(tmp_path / "redis", port=free_port())
    url = server.ensure_started()
    try:
        conn = connect_redis(url, reconnect_for_s=60)
        client = pipeline.Client(conn)
        start_worker(redis_url=url)
        wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 60, "an idle worker")
        # Keep the worker busy so its acknowledgement can only come after the restart.
        busy = client.submit([{**LONG, "id": f"busy{i}"} for i in range(8)], run="busy", output=f"file://{tmp_path}")
        wait_until(lambda: [w.state for w in client.workers()] == ["busy"], 30, "the worker busy")

        results: list[object] = []
        pusher = threading.Thread(
            target=lambda: results.append(client.push_weights(str(v1_model_dir), version=1, timeout=120)))
        pusher.start()
        wait_until(lambda: control_channel.read_state(conn).weight_version == 1, 10, "the desired state written")
        assert control_channel.read_acks(conn, 1) == {}
        server.stop()  # the state is in the AOF; workers and the pusher reconnect with backoff
        time.sleep(1.0)
        server.ensure_started()
        pusher.join(timeout=150)
        [result] = results
        assert [(a.version, a.ok) for a in result.acks] == [(1, True)]  # type: ignore[attr-defined]
        busy.wait(timeout=120)
        assert busy.read().num_rows == 8
        assert {w.weight_version for w in registry.live_workers(conn)} == {1}
        after = client.submit([{**LONG, "id": "after"}], run="after", output=f"file://{tmp_path}")
        after.wait(timeout=60)
        assert after.read().column("weight_version").to_pylist() == [1]
    finally:
        server.stop()
