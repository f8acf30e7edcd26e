"""`batch.take(groups=N, keep=...)` and `submit(groups=N, oversample=F)` on a real run: a sim rollout
worker, a reward worker, DAPO's filter; what remains is canceled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

import pipeline
from pipeline.audit.status import collect
from pipeline.core.jobs.queue import rollout_queue
from pipeline.runs.batch import Batch
from pipeline.runs.take import RewardsFailedWarning, rewards_differ
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker
from workers.rewards.reward_worker import RewardWorker


def requests(count: int) -> list[dict]:
    # Odd requests vary (their two samples get rewards 0 and 1), even ones do not (both 0).
    return [{"id": f"q{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2},
             "metadata": {"vary": i % 2 == 1}} for i in range(count)]


def generate(conn: redis.Redis, jobs: int) -> None:
    """Run the first `jobs` queued rollout jobs on a sim engine; the rest stay queued."""
    engine = SimEngine(SimConfig(step_s=0.0, median_tokens=10_000, p99_tokens=10_001, capacity=64))
    try:
        RolloutWorker(conn, engine, max_jobs_in_flight=1).work(burst=True, max_jobs=jobs, with_scheduler=False,
                                                              logging_level="WARNING")
    finally:
        engine.close()


def scored(conn: redis.Redis, output: Path, monkeypatch: pytest.MonkeyPatch, reward: str, run: str, count: int,
           jobs: int, **options: Any) -> Batch:
    """`count` requests submitted one a job with reward function `reward` (of tests.helpers.reward_functions),
    the first `jobs` of them generated and scored."""
    monkeypatch.setenv("PIPELINE_REWARDS", f"{reward}=tests.helpers.reward_functions:{reward}")
    batch = pipeline.Client(conn).submit(requests(count), run=run, output=f"file://{output}", batch_size=1,
                                         reward=reward, **options)
    generate(conn, jobs=jobs)
    RewardWorker(conn, block_ms=50).work(burst=True)
    return batch


def test_take_keeps_groups_the_filter_accepts_and_cancels_the_rest(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = pipeline.Client(redis_client)
    # q0..q3 generated; q4 waits in the queue
    batch = scored(redis_client, tmp_path, monkeypatch, "varies", "t", 10, jobs=4, groups=2, oversample=2.5)
    assert (batch.plan.requests, batch.plan.groups, len(batch.job_ids)) == (5, 2, 5)  # ceil(2 x 2.5) of 10

    result = batch.take(keep=rewards_differ, timeout=30)

    assert result.groups == ["q1", "q3"] and sorted(result.dropped) == ["q0", "q2"]
    assert result.drop_rate == 0.5
    assert result.table.num_rows == 4 and set(result.table.column("request_id").to_pylist()) == {"q1", "q3"}
    assert sorted(result.table.column("reward").to_pylist()) == [0.0, 0.0, 1.0, 1.0]
    assert result.canceled is not None and result.canceled.queued == 1
    assert rollout_queue(redis_client).count == 0
    assert batch.job_states()[batch.job_ids[4]] == "canceled" and batch.last_take is result
    assert collect(redis_client, run="t")["pools"]["default"]["runs"]["t"]["rewards"]["zero_variance"] == 0.5
    # The follower's option: the same groups, as their shards commit, rewards joined.
    followed = client.follow("t", rewards=True, timeout=30, raise_on_failure=False)
    kept = [g.column("request_id")[0].as_py() for g in followed.groups(keep=rewards_differ)]
    assert kept == ["q1", "q3"] and followed.canceled == {batch.job_ids[4]}


def test_take_without_a_filter_or_rewards_returns_the_first_groups(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(requests(3), run="p", output=f"file://{tmp_path}", batch_size=2)
    generate(redis_client, jobs=2)
    result = batch.take(groups=2, timeout=30)
    assert result.groups == ["q0", "q1"] and result.surplus == ["q2"] and result.canceled is None
    assert "reward" not in result.table.column_names
    with pytest.raises(pipeline.PipelineError, match="submit the batch with a reward function"):
        rewards_differ(result.table)


def test_oversample_needs_groups_and_enough_requests(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    with pytest.raises(pipeline.PipelineError, match="--oversample F needs --groups N"):
        client.submit(requests(4), run="o", output=f"file://{tmp_path}", oversample=2)
    with pytest.raises(pipeline.PipelineError, match="needs 6 requests; the input has 4; nothing was enqueued"):
        client.submit(requests(4), run="o", output=f"file://{tmp_path}", groups=3, oversample=2)
    assert rollout_queue(redis_client).count == 0


def test_take_with_every_reward_failed_warns_instead_of_silently_keeping_nothing(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(redis_client, tmp_path, monkeypatch, "broken", "rf", 3, jobs=3, groups=3)

    with pytest.warns(RewardsFailedWarning) as warned:
        result = batch.take(keep=rewards_differ, timeout=30)

    assert result.groups == [] and sorted(result.dropped) == ["q0", "q1", "q2"]
    assert result.reward_errors == {job_id: "RuntimeError: the grader crashed on purpose" for job_id in batch.job_ids}
    message = str(warned[0].message)
    assert "run rf: the rewards of 3 job(s) failed (reward function 'broken'" in message, message
    assert "RuntimeError: the grader crashed on purpose" in message and "3 group(s)" in message
