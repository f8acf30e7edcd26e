"""Cancel, trainer side, on a real Redis with no worker: queued jobs leave the queue with their
prompt ids in one step, waits and followers end, status shows them, and the commit log refuses
a canceled job's commit."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from rq.job import Job

import pipeline
from pipeline.audit.status import collect
from pipeline.core.broker import commit_log, keys
from pipeline.core.jobs.queue import rollout_queue


def requests(prefix: str, count: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            for i in range(count)]


def statuses(conn: redis.Redis, job_ids: list[str]) -> set[str]:
    return {conn.hget(Job.key_for(j), "status").decode() for j in job_ids}


def test_cancel_of_queued_jobs_removes_them_and_their_prompt_ids(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    before = client.submit(requests("o", 2), run="other", output=f"file://{tmp_path}", batch_size=1)
    doomed = client.submit(requests("a", 5), run="doomed", output=f"file://{tmp_path}", batch_size=2)
    after = client.submit(requests("p", 2), run="other", output=f"file://{tmp_path}", batch_size=1)
    assert all(redis_client.exists(keys.prompts(j)) for j in doomed.job_ids)

    result = client.cancel("doomed")

    assert (result.queued, result.running, result.finished, sorted(result.job_ids)) == (3, 0, 0, sorted(doomed.job_ids))
    # The other run's jobs stay queued, in their order; the canceled ones and their prompt ids are gone.
    assert rollout_queue(redis_client).get_job_ids() == before.job_ids + after.job_ids
    assert not any(redis_client.exists(keys.prompts(j)) for j in doomed.job_ids)
    assert all(redis_client.exists(keys.prompts(j)) for j in before.job_ids + after.job_ids)
    assert statuses(redis_client, doomed.job_ids) == {"canceled"}
    status = doomed.wait(timeout=5)
    assert (status.canceled, status.counts["finished"]) == (3, 0)
    assert doomed.failures() == {}
    follower = client.follow("doomed", timeout=5)
    assert list(follower) == [] and follower.canceled == set(doomed.job_ids) and follower.failed == {}
    pool = collect(redis_client)["pools"]["default"]
    assert pool["runs"]["doomed"]["canceled"] == 3 and pool["runs"]["other"]["canceled"] == 0
    assert pool["queue"]["queued"] == 4
    # A worker that took a job just before the cancel cannot commit it after.
    refused = commit_log.append(redis_client, "doomed", commit_log.Commit(
        job_id=doomed.job_ids[0], batch_id=doomed.plan.batch_id, url="file:///x", rows=1, tokens=1, weight_version=0))
    assert refused is False and commit_log.read_all(redis_client, "doomed") == []
    # Canceling again changes nothing.
    again = client.cancel("doomed")
    assert (again.queued, again.already) == (0, 3)


def test_cancel_by_job_id_and_by_batch_leaves_the_rest(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    first = client.submit(requests("a", 3), run="r", output=f"file://{tmp_path}", batch_size=1)
    second = client.submit(requests("b", 2), run="r", output=f"file://{tmp_path}", batch_size=1)
    client.cancel(job_ids=[first.job_ids[1]])
    assert rollout_queue(redis_client).get_job_ids() == [first.job_ids[0], first.job_ids[2], *second.job_ids]
    second.cancel()
    assert rollout_queue(redis_client).get_job_ids() == [first.job_ids[0], first.job_ids[2]]
    assert first.job_states() == {first.job_ids[0]: "queued", first.job_ids[1]: "canceled",
                                  first.job_ids[2]: "queued"}


def test_cancel_names_what_it_cannot_find_and_changes_nothing(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(requests("a", 2), run="r", output=f"file://{tmp_path}", batch_size=1)
    with pytest.raises(pipeline.PipelineError, match="run 'nope' has no submitted batch"):
        client.cancel("nope")
    with pytest.raises(pipeline.PipelineError, match=r"1 job id.*belong to no submitted batch: zzz-00000"):
        client.cancel(job_ids=[batch.job_ids[0], "zzz-00000"])
    with pytest.raises(pipeline.PipelineError, match=r"submitted to pool 'gpu'.*they are in default"):
        client.cancel("r", pool="gpu")
    assert rollout_queue(redis_client).get_job_ids() == batch.job_ids
    assert redis_client.scard(keys.canceled("r")) == 0


def test_cancel_of_a_run_across_pools_or_in_one(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    default = client.submit(requests("a", 1), run="r", output=f"file://{tmp_path}")
    gpu = client.submit(requests("b", 1), run="r", output=f"file://{tmp_path}", pool="gpu")
    assert client.cancel("r", pool="gpu").job_ids == gpu.job_ids
    assert rollout_queue(redis_client, "gpu").get_job_ids() == []
    assert rollout_queue(redis_client).get_job_ids() == default.job_ids
    assert client.cancel("r").queued == 1
    assert rollout_queue(redis_client).get_job_ids() == []


def test_cancel_on_the_command_line(redis_client: redis.Redis, redis_url: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli.main import main

    batch = pipeline.Client(redis_client).submit(requests("a", 3), run="cli", output=f"file://{tmp_path}",
                                                 batch_size=1)
    assert main(["cancel", "--redis", redis_url, "--run", "cli"]) == 0
    assert "canceled 3 of 3 job(s): 3 removed from the queue, 0 aborted in flight" in capsys.readouterr().out
    assert set(batch.job_states().values()) == {"canceled"}
    assert main(["cancel", "--redis", redis_url]) == 2
    assert "name a run" in capsys.readouterr().err


def test_cancel_counts_only_what_it_canceled_and_status_agrees_with_the_batch(
        redis_client: redis.Redis, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A finished job is left as it was: not counted as canceled by the cancel, by `pipeline status --run`
    (text and --json) or by `batch.status()`."""
    import json

    from pipeline.cli.main import main
    from workers.engines.fake import FakeEngine
    from workers.process.worker import RolloutWorker

    client = pipeline.Client(redis_client)
    done = client.submit(requests("d", 1), run="cf", output=f"file://{tmp_path}")
    RolloutWorker(redis_client, FakeEngine()).work(burst=True, with_scheduler=False, logging_level="WARNING")
    assert done.wait(timeout=30).counts["finished"] == 1
    waiting = client.submit(requests("w", 2), run="cf", output=f"file://{tmp_path}", batch_size=1)

    assert main(["cancel", "--redis", redis_url, "--run", "cf"]) == 0
    out = capsys.readouterr().out
    assert "canceled 2 of 3 job(s): 2 removed from the queue, 0 aborted in flight; left as they were: 1 finished" \
        in out, out
    assert (done.status().counts["finished"], done.status().canceled) == (1, 0)
    assert waiting.status().canceled == 2
    assert main(["status", "--redis", redis_url, "--run", "cf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"]["default"]["runs"]["cf"]["canceled"] == 2
    assert main(["status", "--redis", redis_url, "--run", "cf"]) == 0
    assert ", 2 job(s) canceled" in capsys.readouterr().out

    again = client.cancel("cf")  # nothing left to cancel: nothing counted
    assert (again.canceled, again.already, again.finished) == (0, 2, 1)
    assert main(["status", "--redis", redis_url, "--run", "cf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"]["default"]["runs"]["cf"]["canceled"] == 2
