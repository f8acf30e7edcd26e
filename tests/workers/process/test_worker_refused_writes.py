"""A `pipeline worker` whose Redis refuses writes for a while (a master cut off from its replicas
answers `NOREPLICAS`) waits it out as it waits out a lost connection, then finishes the run: every
request has exactly one row, and the worker never exits (real redis-server, real worker process).
Before, its first refused write ended it ("found an unhandled exception, quitting")."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow.compute as pc

from pipeline.core.broker import commit_log, registry
from pipeline.core.broker.connection import connect_redis
from pipeline.core.broker.redis_server import RedisServer
from pipeline.runs.batch import Batch
from pipeline.submit.enqueue import submit_requests
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from tests.helpers.processes import free_port, log_tail, stop_all, wait_until
from tests.helpers.refusing_redis import allow_writes, refusals, refuse_writes

# Two jobs of two requests in flight at a time: the worker dequeues (a write) all along the run.
SIM = ["--engine", "sim", "--sim-capacity", "4", "--sim-step-ms", "10", "--sim-median-tokens", "20",
       "--sim-p99-tokens", "21",
       "--heartbeat-interval", "0.5", "--log-level", "WARNING"]
REQUESTS = [RolloutRequest(id=f"r{i}", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 20})
            for i in range(60)]


def test_a_worker_waits_out_a_redis_that_refuses_writes(tmp_path: Path, pipeline_env: dict[str, str]) -> None:
    with RedisServer(tmp_path / "redis", port=free_port()) as server:
        admin = server.client()
        env = {**pipeline_env, "PIPELINE_REDIS_URL": server.url}
        log = tmp_path / "worker.log"
        worker = subprocess.Popen([*PIPELINE, "worker", *SIM, "--pool", "refused"], env=env,
                                  stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: len(registry.live_workers(admin, "refused")) == 1, 60, "the worker to register")
            conn = connect_redis(server.url)
            batch = Batch(conn, submit_requests(conn, REQUESTS, run="refused", pool="refused",
                                                output=f"file://{tmp_path}/shards", batch_size=2))
            wait_until(lambda: len(commit_log.read_all(admin, "refused")) >= 3, 60, "the run to be under way")
            before = refusals(admin)
            refuse_writes(admin)
            # The worker keeps trying: refused again and again, and alive (it used to quit at the first).
            wait_until(lambda: refusals(admin) >= before + 10 or worker.poll() is not None, 60, "ten refusals")
            assert worker.poll() is None, log_tail(log)
            allow_writes(admin)
            status = batch.wait(timeout=120)
            assert status.counts["finished"] == len(batch.job_ids), status
            assert worker.poll() is None, log_tail(log)
            rows = batch.read(["request_id"])
            counts = pc.value_counts(rows["request_id"]).to_pylist()
            assert sorted(c["values"] for c in counts) == sorted(r.id for r in REQUESTS)
            assert {c["counts"] for c in counts} == {1}  # exactly one row each
        finally:
            allow_writes(admin)
            stop_all([worker])
        # Waited out, not failed: no job failed on a refused write, nothing logged as an error.
        assert " ERROR " not in log.read_text(), log_tail(log)
