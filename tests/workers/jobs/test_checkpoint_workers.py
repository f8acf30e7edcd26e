"""Resume, don't restart: `pipeline worker` processes on the hf engine (tiny random model) and the real
Redis; a worker SIGKILLed with samples in flight, its job taken by another worker, which continues
every checkpointed sample from its last saved token. Every stored logprob is checked against
teacher forcing (`pipeline.verify`) under the version recorded for its token.

The victim runs an hf engine held after `HELD` tokens of every sample (`held_hf_worker`: until a
partial swap stops it, or the kill), so it is always killed mid-sample, whatever the machine's
speed. The tests wait on the checkpoint in Redis (its pieces) and on the batch, never on sleeps.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis

import pipeline
from pipeline.core.broker import commit_log, keys, registry
from tests.helpers.adapters import build_adapter
from tests.helpers.processes import wait_until
from tests.workers.jobs.held_hf_worker import HOLD_VARIABLE
from workers.jobs.checkpoint import CheckpointStore
from workers.rows.continuation import Piece

# Registry scans fast, so the dead worker's job is retried within seconds (heartbeats every 2 s: a
# worker whose decode loop starves its heartbeat thread on a busy machine is not taken for dead).
# The waits below are safety nets sized for a machine running several suites at once (a worker's
# start, torch and the model, took over 2 minutes there).
FAST = ("--heartbeat-interval", "2", "--maintenance-interval", "1", "--max-top-logprobs", "2")
LENGTH = 64
HELD = 24  # the victim's engine holds each decode group after this many tokens of every sample
HELD_WORKER = {"module": "tests.workers.jobs.held_hf_worker", "env": {HOLD_VARIABLE: str(HELD)}}


def saved(conn: redis.Redis, job_id: str) -> dict[tuple[int, int], list[Piece]]:
    return CheckpointStore(conn).load(job_id)


def tokens(chain: list[Piece]) -> np.ndarray:
    return np.concatenate([p.token_ids for p in chain])


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def long_requests() -> list[dict]:
    return [
        {"id": "sampled", "input_ids": [5, 6, 7], "logprobs": 2,
         "sampling_params": {"max_new_tokens": LENGTH, "n": 2, "seed": 3, "temperature": 0.8, "ignore_eos": True}},
        {"id": "greedy", "input_ids": [9, 8], "logprobs": 2,
         "sampling_params": {"max_new_tokens": LENGTH, "temperature": 0, "ignore_eos": True}},
    ]


def check_verified(conn: redis.Redis, run: str, models: dict[int, Path], rows: list[dict]) -> None:
    """Every stored logprob equals teacher forcing under its token's recorded version (<= 1e-3)."""
    report = pipeline.verify(run, {v: str(p) for v, p in models.items()}, conn=conn, threshold=1e-3)
    assert report.tokens == sum(len(r["completion_token_ids"]) for r in rows)
    assert report.resumed_rows == sum(r["resumed_at"] is not None for r in rows) > 0
    assert report.max_abs_diff <= 1e-3, report.to_dict()


def test_a_worker_killed_mid_sample_is_resumed_by_another(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, start_worker: Callable[..., subprocess.Popen]
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(long_requests(), run="resume", output=f"file://{tmp_path}", batch_size=8)
    (job_id,) = batch.job_ids
    victim = start_worker("--checkpoint-every", "0.2", *FAST, **HELD_WORKER)
    wait_until(lambda: len(saved(redis_client, job_id)) == 3 and all(
        len(tokens(c)) == HELD for c in saved(redis_client, job_id).values()), 300, "a checkpoint of every sample")
    kill(victim)
    before = saved(redis_client, job_id)  # what the victim saved, read after its death
    assert all(len(tokens(c)) == HELD for c in before.values())  # killed mid-sample
    assert commit_log.read_all(redis_client, "resume") == []
    start_worker("--checkpoint-every", "0.2", *FAST)
    assert batch.wait(timeout=300).counts["finished"] == 1
    rows = batch.read().to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == ["greedy:0", "sampled:0", "sampled:1"]  # none lost, none twice
    slot = {"sampled": 0, "greedy": 1}
    for row in rows:
        chain = before[(slot[row["request_id"]], row["sample_index"])]
        kept = len(tokens(chain))
        assert len(row["completion_token_ids"]) == LENGTH  # the budget counts the whole completion
        assert row["resumed_at"] == [kept] == [HELD]  # the resume point, recorded
        assert row["completion_token_ids"][:kept] == tokens(chain).tolist()  # each token once, the dead worker's
        assert np.allclose(row["completion_logprobs"][:kept], np.concatenate([p.logprobs for p in chain]))
        assert [len(position) for position in row["completion_top_logprobs"]] == [2] * LENGTH
        assert row["weight_version_segments"] is None  # one version: the pool never changed its weights
    sampled = [r["completion_token_ids"] for r in rows if r["request_id"] == "sampled"]
    assert sampled[0] != sampled[1]  # n=2: each sample keeps its own seed across the resume
    check_verified(redis_client, "resume", {0: tiny_model_dir}, rows)
    assert not redis_client.exists(keys.checkpoint(job_id))  # deleted with the commit


def test_a_worker_killed_before_its_first_checkpoint_restarts_from_the_prompt(
    redis_client: redis.Redis, tmp_path: Path, start_worker: Callable[..., subprocess.Popen]
) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit(long_requests(), run="early", output=f"file://{tmp_path}", batch_size=8)
    (job_id,) = batch.job_ids
    victim = start_worker("--checkpoint-every", "3600", *FAST, **HELD_WORKER)
    wait_until(lambda: any(w.current_job == job_id for w in registry.live_workers(redis_client)), 300,
               "the victim to start the job")
    kill(victim)  # held mid-sample: the job cannot have finished
    assert not redis_client.exists(keys.checkpoint(job_id))
    start_worker("--checkpoint-every", "3600", *FAST)
    assert batch.wait(timeout=300).counts["finished"] == 1
    rows = batch.read().to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == ["greedy:0", "sampled:0", "sampled:1"]
    assert all(r["resumed_at"] is None and len(r["completion_token_ids"]) == LENGTH for r in rows)


def test_a_worker_killed_after_a_partial_swap_resumes_on_the_new_weights(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, v1_model_dir: Path,
    start_worker: Callable[..., subprocess.Popen],
) -> None:
    """The swap's checkpoint holds the v0 tokens; the continuation's on v1 follow; killed then, the
    job resumes on another worker (which loads the pool's v1): each token checked under its version.
    The victim holds after `HELD` tokens on v0; the swap stops it there, and it holds again after
    `HELD` tokens on v1."""
    client = pipeline.Client(redis_client)
    batch = client.submit(long_requests(), run="swap", output=f"file://{tmp_path}", batch_size=8)
    (job_id,) = batch.job_ids
    victim = start_worker("--checkpoint-every", "0.2", *FAST, **HELD_WORKER)
    wait_until(lambda: len(saved(redis_client, job_id)) == 3 and all(
        len(tokens(c)) == HELD for c in saved(redis_client, job_id).values()), 300, "a checkpoint of the held samples")
    acks = client.push_weights(str(v1_model_dir), version=1, mode="partial", timeout=60).acks
    assert [a.mode for a in acks] == ["partial"]

    def on_v1() -> bool:
        chains = saved(redis_client, job_id)
        return len(chains) == 3 and all(len(tokens(c)) == 2 * HELD and c[-1].version == 1 for c in chains.values())

    wait_until(on_v1, 300, "checkpoints of tokens generated on v1")
    kill(victim)
    before = saved(redis_client, job_id)
    start_worker("--checkpoint-every", "0.2", *FAST)
    assert batch.wait(timeout=300).counts["finished"] == 1
    rows = batch.read().to_pylist()
    assert len(rows) == 3
    slot = {"sampled": 0, "greedy": 1}
    for row in rows:
        chain = before[(slot[row["request_id"]], row["sample_index"])]
        boundary = next(p.start for p in chain if p.version == 1)
        assert boundary == HELD  # the swap stopped the held samples there
        assert [(s["start"], s["version"]) for s in row["weight_version_segments"]] == [(0, 0), (boundary, 1)]
        assert row["resumed_at"] == [2 * HELD] and len(row["completion_token_ids"]) == LENGTH
    check_verified(redis_client, "swap", {0: tiny_model_dir, 1: v1_model_dir}, rows)


def test_a_job_resumed_after_an_adapter_push_keeps_the_version_its_tokens_came_from(
    redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path, pipeline_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch, start_worker: Callable[..., subprocess.Popen],
) -> None:
    """Killed mid-sample on adapter sql v1, pushed v2 meanwhile: the worker that resumes the job runs
    its samples on v1 to the end (a sample never mixes versions), and its rows say v1; the job after
    it runs v2. Each logprob is checked under base + the version its row names."""
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the workers' default store too
    client = pipeline.Client(redis_client)
    client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql1", seed=1), base=tiny_model_dir)
    on_sql = [{**request, "adapter": "sql"} for request in long_requests()]
    batch = client.submit(on_sql, run="pinned", output=f"file://{tmp_path}", batch_size=8)
    (job_id,) = batch.job_ids
    victim = start_worker("--checkpoint-every", "0.2", *FAST, **HELD_WORKER)
    wait_until(lambda: len(saved(redis_client, job_id)) == 3 and all(
        len(tokens(c)) == HELD for c in saved(redis_client, job_id).values()), 300, "a checkpoint of every sample")
    assert CheckpointStore(redis_client).load_adapters(job_id) == {"sql": 1}
    pushed = client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "sql2", seed=2), base=tiny_model_dir)
    assert [(a.version, a.ok) for a in pushed.acks] == [(2, True)]  # the held victim answers all the same
    kill(victim)
    start_worker("--checkpoint-every", "0.2", *FAST)
    assert batch.wait(timeout=300).counts["finished"] == 1
    rows = batch.read().to_pylist()
    assert [(r["adapter"], r["adapter_version"], r["resumed_at"]) for r in rows] == [("sql", 1, [HELD])] * 3
    check_verified(redis_client, "pinned", {0: tiny_model_dir}, rows)
    assert not redis_client.exists(keys.checkpoint_adapters(job_id))  # deleted with the commit
    after = client.submit(on_sql[1:], run="after", output=f"file://{tmp_path}")
    after.wait(timeout=300)
    assert [r["adapter_version"] for r in after.read().to_pylist()] == [2]


def test_a_negative_interval_is_refused_before_anything_loads(pipeline_env: dict[str, str]) -> None:
    import sys

    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "worker", "--checkpoint-every", "-1"],
                          env=pipeline_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--checkpoint-every must be >= 0 seconds (0: off), got -1" in done.stderr
