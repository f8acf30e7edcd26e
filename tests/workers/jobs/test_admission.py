"""Jobs run only where they can be served: hand-back of a job a worker cannot serve (no retry
spent, nothing run), the bounded wait and failure when no live worker can, deterministic
refusals never retried on the same worker, and a mixed pool served without a failure."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

import pipeline
from pipeline.audit.status import collect, format_status
from pipeline.core.broker import keys, registry
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities, WorkerInfo
from tests.helpers.processes import run_burst
from workers.engines.base import SampleOutput
from workers.engines.fake import FakeEngine
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.errors import UnsupportedRequestError
from workers.process.worker import RolloutWorker

TOP3 = {"id": "t", "input_ids": [1, 2], "logprobs": 3, "sampling_params": {"max_new_tokens": 3}}


def _worker(conn: redis.Redis, engine: object, worker_id: str) -> RolloutWorker:
    worker = RolloutWorker(conn, engine, worker_id=worker_id, control_poll_s=0.1)  # type: ignore[arg-type]
    worker.set_registry_state("idle")  # live in the registry before its loop starts, as a started worker is
    return worker


def _sim(**config: object) -> SimEngine:
    return SimEngine(SimConfig(step_s=0.0, median_tokens=3, p99_tokens=6, vocab_size=1000, **config))  # type: ignore[arg-type]


def _job(conn: redis.Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def test_a_job_the_worker_cannot_serve_is_handed_back_untouched_for_one_that_can(
    redis_client: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit([TOP3], run="handback", output=f"file://{tmp_path}")  # no worker live: no submit check
    plain_engine = FakeEngine(max_top_logprobs=0)
    able = _worker(redis_client, _sim(max_top_logprobs=5), "able")
    plain = _worker(redis_client, plain_engine, "plain")
    with caplog.at_level(logging.INFO, logger="workers.process.intake"):
        run_burst(plain, close=True)  # dequeues it, hands it back, goes round the queue, stops
    assert f"job {batch.job_ids[0]} handed back: worker plain lacks top-3 logprobs; 1 other live worker(s) can " \
           "serve it" in caplog.text
    assert plain_engine.calls == []
    job = _job(redis_client, batch.job_ids[0])
    assert job.get_status() == "queued" and job.retries_left == 2 and "handed_back" not in job.meta
    assert collect(redis_client)["pools"]["default"]["unservable"] == {}  # someone can serve it
    run_burst(able, close=True)
    assert batch.wait(timeout=10).counts["finished"] == 1
    assert batch.read().column("worker_id").to_pylist() == ["able"]


def test_a_job_no_live_worker_can_serve_waits_then_fails_with_the_reason(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "3600")
    client = pipeline.Client(redis_client)
    batch = client.submit([TOP3], run="nobody", output=f"file://{tmp_path}")
    engine = FakeEngine(max_top_logprobs=0)
    run_burst(_worker(redis_client, engine, "plain"), close=True)  # within the wait: handed back, listed as waiting
    status = collect(redis_client)["pools"]["default"]
    [(job_id, waiting)] = status["unservable"].items()
    assert job_id == batch.job_ids[0] and "it needs top-3 logprobs" in waiting["reason"]
    assert "waiting for a capability no live worker has: 1 job(s)" in format_status(collect(redis_client))
    assert batch.status().counts["queued"] == 1
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")  # the wait is over
    run_burst(_worker(redis_client, engine, "plain"), close=True)
    failures = batch.failures()
    assert "UnservableJobError: job" in failures[job_id]
    assert "no live worker of pool 'default' can serve it" in failures[job_id]
    assert engine.calls == []  # nothing ever ran
    assert FailedJobRegistry(keys.pool().queue_name, connection=redis_client).get_job_ids() == [job_id]
    assert len(list(_job(redis_client, job_id).results())) == 1  # failed once, not retried
    assert collect(redis_client)["pools"]["default"]["unservable"] == {}


def test_a_token_id_beyond_the_vocabulary_submitted_with_no_worker_live_is_never_retried(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")
    client = pipeline.Client(redis_client)  # no worker live: submit cannot check the ids
    batch = client.submit([{"id": "big", "input_ids": [1, 5000]}], run="vocab", output=f"file://{tmp_path}")
    engine = FakeEngine()  # vocabulary of 1000
    run_burst(_worker(redis_client, engine, "small"), close=True)
    [job_id] = batch.job_ids
    assert engine.calls == []  # refused before it ran, not run and failed
    assert "token id 5000 in its vocabulary" in batch.failures()[job_id]
    assert len(list(_job(redis_client, job_id).results())) == 1  # failed once, not retried


class Refusing(FakeEngine):
    """Refuses every request (as an SGLang server with a shorter context would): deterministic."""

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        self.calls.append([r.id for r in requests])
        raise UnsupportedRequestError(f"request {requests[0].id!r}: prompt longer than this server's context")


def test_a_deterministic_refusal_is_never_retried_on_the_same_worker(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_UNSERVABLE_WAIT_S", "0")
    client = pipeline.Client(redis_client)
    plain = {"id": "p", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    served = client.submit([plain], run="refused", output=f"file://{tmp_path}")
    refusing = Refusing()
    other = _worker(redis_client, FakeEngine(), "other")
    run_burst(_worker(redis_client, refusing, "short"), close=True)
    assert refusing.calls == [["p"]]  # ran once; passed over after its refusal, no retry spent on it
    job = _job(redis_client, served.job_ids[0])
    assert job.get_status() == "queued" and job.retries_left == 2 and job.meta["refused_by"] == ["short"]
    run_burst(other, close=True)
    assert served.wait(timeout=5).counts["finished"] == 1
    assert served.read().column("worker_id").to_pylist() == ["other"]

    # Nobody else: it fails, naming the refusal, after one run.
    alone = client.submit([{**plain, "id": "q"}], run="refused-alone", output=f"file://{tmp_path}")
    run_burst(_worker(redis_client, refusing, "short"), close=True)
    assert refusing.calls == [["p"], ["q"]]
    reason = alone.failures()[alone.job_ids[0]]
    assert "refused by short" in reason and "longer than this server's context" in reason


def _register(conn: redis.Redis, worker_id: str, capabilities: Capabilities, pool: str = "default") -> None:
    now = time.time()
    registry.publish(conn, WorkerInfo(worker_id=worker_id, pool=pool, host="h", pid=1, engine="sim", model="m",
                                      capabilities=capabilities, started_at=now, heartbeat_at=now))


def test_submit_checks_each_request_against_each_live_worker(redis_client: redis.Redis, tmp_path: Path) -> None:
    _register(redis_client, "dense", Capabilities(max_top_logprobs=5))
    _register(redis_client, "moe", Capabilities(routed_experts=True))
    _register(redis_client, "other-pool", Capabilities(max_top_logprobs=5, routed_experts=True), pool="big")
    client = pipeline.Client(redis_client)
    both = {**TOP3, "id": "both", "logprobs": 5, "return_routed_experts": True}
    with pytest.raises(pipeline.CapabilityError) as refused:
        client.submit([{**TOP3, "id": "fine"}, both], output=f"file://{tmp_path}")
    message = str(refused.value)
    assert "request 'both': no single live worker of pool 'default' has all it asks" in message
    assert "lack routed experts" in message and "lack top-5 logprobs" in message and "'fine'" not in message
    with pytest.raises(pipeline.CapabilityError, match=r"request 'k9': no live worker of pool 'default' has "
                                                       r"top-9 logprobs \(start a worker with --max-top-logprobs 9\)"):
        client.submit([{**TOP3, "id": "k9", "logprobs": 9}], output=f"file://{tmp_path}")
    assert pipeline.Client(redis_client, pool="big").submit([both], output=f"file://{tmp_path}").plan.pool == "big"
    status = collect(redis_client)["pools"]["default"]
    assert sorted((c["serves"], c["workers"]) for c in status["capability_classes"]) == [
        ("no top-k logprobs, routed experts", 1), ("top-5 logprobs, no routed experts", 1)]


def test_a_mixed_pool_serves_a_mixed_file_with_no_failure_and_no_wasted_run(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    dense = _worker(redis_client, _sim(max_top_logprobs=5), "dense-topk")
    moe = _worker(redis_client, _sim(experts=(2, 2, 8)), "moe")
    requests = []
    for i in range(12):
        kind = i % 3
        requests.append({"id": f"r{i}", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4},
                         "logprobs": 5 if kind == 0 else 0, "return_routed_experts": kind == 1})
    batch = pipeline.Client(redis_client).submit(requests, run="mixed", output=f"file://{tmp_path}", batch_size=2)
    # Packed by who can serve them: top-k with top-k, routed with routed, the plain ones together.
    assert len(batch.job_ids) == 6
    run_burst(moe, close=True)  # takes the jobs it serves, passes over the top-k ones
    run_burst(dense, close=True)
    assert batch.wait(timeout=10).counts == {"finished": 6}
    admitted = [job_id for w in (moe, dense) for _, job_id in w.feeder.admitted]  # type: ignore[union-attr]
    assert sorted(admitted) == sorted(batch.job_ids)  # every job ran once, on a worker that served it
    rows = batch.read().to_pylist()
    for row in rows:
        index = int(row["request_id"][1:])
        if index % 3 == 0:
            assert row["worker_id"] == "dense-topk" and len(row["completion_top_logprobs"][0]) == 5
        if index % 3 == 1:
            assert row["worker_id"] == "moe" and row["routed_experts"] is not None
    assert FailedJobRegistry(keys.pool().queue_name, connection=redis_client).count == 0
