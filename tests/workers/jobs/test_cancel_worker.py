"""Cancel, worker side: in-process workers on the real Redis with the sim engine. A job in flight
is aborted on the engine, writes no shard and commits nothing; a finished job's shard and
commit stay; a job whose generation cannot be stopped (no feeding) is not committed either."""

from __future__ import annotations

from pathlib import Path

import redis
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import commit_log, keys
from tests.helpers.processes import drive_worker, wait_until
from workers.engines.sim.engine import SimConfig, SimEngine


def job(prefix: str, tokens: list[int]) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": n}}
            for i, n in enumerate(tokens)]


def engine() -> SimEngine:
    # Every sequence runs to its max_new_tokens (median far above it), 2 ms a step.
    return SimEngine(SimConfig(step_s=0.002, median_tokens=10_000, p99_tokens=10_001, capacity=16))


def files(directory: Path) -> list[str]:
    """Every file under the run's directory, hidden temporaries included."""
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def test_cancel_aborts_a_running_job_and_keeps_finished_shards(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    short = client.submit(job("s", [3, 3]), run="c", output=output)
    long = client.submit(job("l", [50_000, 50_000]), run="c", output=output)  # 100 s of steps
    queued = client.submit(job("q", [3]), run="c", output=output)
    sim = engine()
    results = []

    def driver() -> None:
        assert short.wait(timeout=20).counts["finished"] == 1
        wait_until(lambda: long.job_states()[long.job_ids[0]] == "started" and sim.load() == 2,
                   what="the long job on the engine")
        results.append(client.cancel("c"))
        status = long.wait(timeout=20)  # ends: the job is canceled, not failed
        assert status.canceled == 1
        assert queued.wait(timeout=5).canceled == 1

    worker = drive_worker(redis_client, sim, driver, max_jobs_in_flight=1)
    result = results[0]
    assert (result.running, result.finished) == (1, 1)
    assert sim.load() == 0 and worker.feeder is not None and worker.feeder.in_flight == 0
    # Only the finished job's shard and commit; no temporary file of the canceled one.
    assert files(tmp_path / "c") == [f"{short.job_ids[0]}.parquet"]
    assert [c.job_id for c in commit_log.read_all(redis_client, "c")] == short.job_ids
    assert short.read().num_rows == 2
    started = StartedJobRegistry(keys.pool().queue_name, connection=redis_client, serializer=JSONSerializer)
    assert started.get_job_ids() == []
    assert redis_client.hget(f"rq:job:{long.job_ids[0]}", "status") == b"canceled"
    follower = client.follow("c", timeout=5)
    assert [s.job_id for s in follower] == short.job_ids
    assert follower.canceled == {long.job_ids[0], queued.job_ids[0]} and follower.failed == {}


def test_a_job_canceled_while_an_unfed_engine_generates_is_not_committed(
    redis_client: redis.Redis, tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(job("u", [500]), run="u", output=f"file://{tmp_path}")
    sim = engine()

    def driver() -> None:
        wait_until(lambda: sim.load() == 1, what="the job on the engine")
        client.cancel("u")
        assert batch.wait(timeout=20).canceled == 1

    drive_worker(redis_client, sim, driver, feed=False)
    assert files(tmp_path / "u") == []
    assert commit_log.read_all(redis_client, "u") == []
    assert redis_client.exists(keys.run_totals("u")) == 0
