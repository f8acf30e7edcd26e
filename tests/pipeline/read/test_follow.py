"""`client.follow`: shards as they commit, exactly once across a consumer restart with its cursor,
ending when the batch or the run is complete, against a real redis-server."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import redis
from rq.job import Job

from pipeline.client import Client
from pipeline.core.broker import keys
from pipeline.core.broker.commit_log import Commit, append
from pipeline.core.errors import JobsFailedError, PipelineError, UnknownRunError, WaitTimeoutError
from pipeline.read.follow import Shard
from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.rows.shard_writer import write_shard
from workers.rows.table import RowContext, build_table

RUN = "follow-run"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def register_batch(conn: redis.Redis, batch_id: str, jobs: int, run: str = RUN) -> list[str]:
    """What `pipeline.submit.enqueue` records for a batch: its job ids and the run's batch set."""
    job_ids = [f"{batch_id}-{i:05d}" for i in range(jobs)]
    conn.hset(keys.batch(batch_id), mapping={"run": run, "job_ids": ",".join(job_ids)})
    conn.sadd(keys.run_batches(run), batch_id)
    return job_ids


def job_table(job_id: str, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    request = RolloutRequest.model_validate({
        "id": f"{job_id}-q", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 6, "n": 2},
        "logprobs": 0,
    })
    samples = []
    for _ in range(2):
        length = int(rng.integers(1, 6))
        samples.append(SampleOutput(token_ids=rng.integers(3, 60, length).astype(np.int32),
                                    finish=Finish("length"),
                                    logprobs=-rng.random(length).astype(np.float32)))
    ctx = RowContext(run=RUN, job_id=job_id, engine="test", model="m", worker_id="w",
                     weight_version=seed, submitted_at=NOW, started_at=NOW, finished_at=NOW)
    return build_table([request], [samples], ctx)


def commit_job(conn: redis.Redis, output: str, job_id: str, seed: int = 0) -> pa.Table:
    """Write the job's shard, then append its commit, as a worker does."""
    table = job_table(job_id, seed)
    url = write_shard(table, output, RUN, job_id)
    append(conn, RUN, Commit(job_id=job_id, batch_id=job_id.rsplit("-", 1)[0], url=url,
                             rows=table.num_rows, tokens=0, weight_version=seed))
    return table


def test_every_shard_exactly_once_across_a_consumer_restart(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    output = str(tmp_path / "out")
    client = Client(redis_client)
    jobs = register_batch(redis_client, "b1", 6)
    tables = {job: commit_job(redis_client, output, job, seed=i) for i, job in enumerate(jobs[:4])}

    first = client.follow(RUN, block_ms=50, timeout=10)
    delivered: list[Shard] = []
    saved_cursor = None
    for shard in first:
        delivered.append(shard)
        assert shard.read().equals(tables[shard.job_id])
        saved_cursor = first.cursor  # persisted after the shard is processed
        if len(delivered) == 3:
            break  # the consumer dies here
    assert saved_cursor == delivered[-1].cursor

    # while it is down: job 0 is retried and commits again; jobs 4 and 5 commit
    commit_job(redis_client, output, jobs[0], seed=0)
    for i, job in enumerate(jobs[4:], start=4):
        tables[job] = commit_job(redis_client, output, job, seed=i)

    second = client.follow(RUN, cursor=saved_cursor, block_ms=50, timeout=10)
    rest = list(second)  # ends by itself: the batch is complete
    got = [s.job_id for s in delivered + rest]
    assert sorted(got) == jobs and len(got) == len(set(got))
    for shard in rest:
        assert shard.read().equals(tables[shard.job_id])
    # the cursor moved past the last entry, and from there nothing is left
    assert list(client.follow(RUN, cursor=second.cursor, block_ms=50, timeout=10)) == []
    # without a cursor, from the start: each job once (the retry's second commit skipped)
    assert sorted(s.job_id for s in client.follow(RUN, block_ms=50, timeout=10)) == jobs


def test_blocks_for_live_commits_and_ends_when_the_run_is_complete(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    output = str(tmp_path / "out")
    jobs = register_batch(redis_client, "b1", 2) + register_batch(redis_client, "b2", 2)

    def worker() -> None:
        for i, job in enumerate(jobs):
            time.sleep(0.15)
            commit_job(redis_client, output, job, seed=i)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        follower = Client(redis_client).follow(RUN, block_ms=2000, timeout=20)
        arrivals = []
        for shard in follower:
            arrivals.append((shard.job_id, time.monotonic()))
    finally:
        thread.join()
    assert [job for job, _ in arrivals] == jobs
    # delivered as committed (blocking), not all at once at the end
    assert arrivals[-1][1] - arrivals[0][1] > 0.3


def test_follows_one_batch_only(tmp_path: Path, redis_client: redis.Redis) -> None:
    output = str(tmp_path / "out")
    jobs1 = register_batch(redis_client, "b1", 2)
    jobs2 = register_batch(redis_client, "b2", 2)
    commit_job(redis_client, output, jobs2[0])
    for job in jobs1:
        commit_job(redis_client, output, job)
    # b2 is not complete, yet following b1 ends
    got = [s.job_id for s in Client(redis_client).follow(RUN, batch_id="b1", block_ms=50, timeout=10)]
    assert got == jobs1
    with pytest.raises(WaitTimeoutError):
        list(Client(redis_client).follow(RUN, batch_id="b2", block_ms=50, timeout=0.5))
    with pytest.raises(PipelineError, match="unknown"):
        list(Client(redis_client).follow(RUN, batch_id="nope", block_ms=50, timeout=5))


def test_failed_jobs_end_the_follow(tmp_path: Path, redis_client: redis.Redis) -> None:
    output = str(tmp_path / "out")
    jobs = register_batch(redis_client, "b1", 3)
    commit_job(redis_client, output, jobs[0])
    commit_job(redis_client, output, jobs[2])
    redis_client.hset(Job.key_for(jobs[1]), "status", "failed")
    follower = Client(redis_client).follow(RUN, block_ms=50, timeout=10)
    got = []
    with pytest.raises(JobsFailedError, match=jobs[1]):
        for shard in follower:
            got.append(shard.job_id)
    assert got == [jobs[0], jobs[2]]
    quiet = Client(redis_client).follow(RUN, block_ms=50, timeout=10, raise_on_failure=False)
    assert [s.job_id for s in quiet] == [jobs[0], jobs[2]]
    assert set(quiet.failed) == {jobs[1]}


def test_a_run_with_no_jobs_fails_fast_naming_the_runs_there(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = Client(redis_client)
    with pytest.raises(UnknownRunError, match=f"run {RUN!r} has no jobs in this Redis .*runs submitted here: nothing"):
        list(client.follow(RUN, timeout=5))  # failing fast, not after the timeout (nor never without one)
    client.submit([{"id": "a", "input_ids": [1, 2]}], run=RUN, output=f"file://{tmp_path}")
    typo = RUN.replace("-", "_")
    with pytest.raises(UnknownRunError, match=f"runs submitted here: {RUN}; did you mean {RUN!r}"):
        list(client.follow(typo, timeout=5))
    with pytest.raises(PipelineError, match="block_ms"):
        Client(redis_client).follow(RUN, block_ms=0)
    with pytest.raises(PipelineError, match="cursor"):
        Client(redis_client).follow(RUN, cursor="yesterday")


def test_follows_a_batch_as_submit_records_it(tmp_path: Path, redis_client: redis.Redis) -> None:
    """The batch bookkeeping comes from a real submit; commits as the jobs' worker would make."""
    client = Client(redis_client)
    requests = [{"id": f"q{i}", "input_ids": [1, 2, 3]} for i in range(5)]
    batch = client.submit(requests, run=RUN, output=str(tmp_path / "out"), batch_size=2)
    assert len(batch.job_ids) == 3
    commit_job(redis_client, batch.output, batch.job_ids[0])
    follower = client.follow(RUN, batch_id=batch.plan.batch_id, block_ms=50, timeout=10)
    got = []
    for shard in follower:
        got.append(shard.job_id)
        if len(got) < len(batch.job_ids):
            commit_job(redis_client, batch.output, batch.job_ids[len(got)])
        if len(got) == 1:
            # a shard of another batch of the run is not this follower's
            other = register_batch(redis_client, "other", 1)
            commit_job(redis_client, batch.output, other[0])
        assert shard.batch_id == batch.plan.batch_id
    assert got == batch.job_ids
