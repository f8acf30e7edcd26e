"""The control channel, worker side: in-process workers with a fake engine for the fine cases,
real worker processes (hf engine, tiny model) on the real Redis for pushes, pauses and late starts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker import control_channel, keys, registry
from tests.conftest import PIPELINE
from tests.helpers.processes import burst_worker, wait_until
from workers.engines.fake import FakeEngine
from workers.errors import WeightsRefusedError
from workers.process.worker import RolloutWorker

REQUEST = {"id": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
FAST_BEATS = ("--heartbeat-interval", "0.5")  # the negative checks wait for two of them


def _queued(conn: redis.Redis) -> list[str]:
    return Queue(keys.pool().queue_name, connection=conn, serializer=JSONSerializer).get_job_ids()




# -- in-process workers, fake engine ---------------------------------------------------------------


def test_paused_burst_worker_takes_nothing(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    client.pause()
    batch = client.submit([REQUEST], run="held", output=f"file://{tmp_path}")
    engine = FakeEngine()
    burst_worker(redis_client, engine, control_poll_s=0.2)
    assert engine.calls == [] and _queued(redis_client) == batch.job_ids
    client.resume()
    burst_worker(redis_client, engine, control_poll_s=0.2)
    assert batch.wait(timeout=5).counts["finished"] == 1


def test_min_weight_version_waits_for_the_push_then_runs_on_it(redis_client: redis.Redis, tmp_path: Path) -> None:
    client = pipeline.Client(redis_client)
    batch = client.submit([REQUEST], run="mwv", output=f"file://{tmp_path}", min_weight_version=1)
    engine = FakeEngine()
    burst_worker(redis_client, engine, control_poll_s=0.2)  # v1 not pushed yet: handed back, untouched
    assert engine.calls == [] and _queued(redis_client) == batch.job_ids
    client.push_weights("/ckpt/v1", version=1, timeout=5)  # no live worker: returns at once
    burst_worker(redis_client, engine, control_poll_s=0.2)  # loads v1 before its first job
    assert engine.updates == [("/ckpt/v1", 1)]
    assert batch.wait(timeout=5).counts["finished"] == 1
    assert batch.read().column("weight_version").to_pylist() == [1]
    [ack] = control_channel.read_acks(redis_client, 1).values()
    assert ack.ok and ack.version == 1


def test_a_worker_that_cannot_load_the_pools_weights_refuses_to_join(
    redis_client: redis.Redis, tmp_path: Path
) -> None:
    client = pipeline.Client(redis_client)
    client.push_weights("/ckpt/bad", version=1, timeout=5)  # no live worker: recorded for those that join
    needs_v1 = client.submit([REQUEST], run="needs", output=f"file://{tmp_path}", min_weight_version=1)
    any_version = client.submit([REQUEST], run="any", output=f"file://{tmp_path}")
    engine = FakeEngine()
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.2)
    with pytest.raises(WeightsRefusedError) as info:
        worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
    message = str(info.value)
    assert f"worker {worker.worker_id} (fake engine, model {engine.description.model}) does not join pool " \
        "'default': the pool serves weights v1 from /ckpt/bad" in message
    assert "no weights at /ckpt/bad" in message and "--force" in message
    [ack] = control_channel.read_acks(redis_client, 1).values()  # the pusher's view says why, too
    assert not ack.ok and "no weights at /ckpt/bad" in (ack.error or "")
    # It served nothing (no row at a "v0" that is not the pool's v0) and left no registry entry.
    assert engine.calls == [] and engine.weight_version == 0
    assert _queued(redis_client) == needs_v1.job_ids + any_version.job_ids
    assert registry.live_workers(redis_client) == []


def test_a_replayed_older_signed_state_is_refused(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_CONTROL_SECRET", "s3cret")  # every state signed
    client = pipeline.Client(redis_client)
    client.push_weights("/ckpt/v1", version=1, timeout=5)
    copied = redis_client.get(keys.pool().control_state)  # a validly signed record, copied by whoever can read Redis
    client.push_weights("/ckpt/v2", version=2, timeout=5)
    followed = redis_client.get(keys.pool().control_state)
    engine = FakeEngine()
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.2)
    worker.sync_control()
    assert engine.updates == [("/ckpt/v2", 2)] and worker.info.control_generation == 2
    redis_client.set(keys.pool().control_state, copied)  # replayed: would roll the weights back to v1
    worker.sync_control()
    assert engine.updates == [("/ckpt/v2", 2)] and engine.weight_version == 2
    # The worker writes the record it follows back (as after a failover that lost it): Redis and workers agree.
    assert redis_client.get(keys.pool().control_state) == followed
    # Redis loses the state: the next change still goes past what the live worker followed.
    worker.set_registry_state("idle")
    redis_client.delete(keys.pool().control_state)
    assert client.pause().generation == 3
    assert worker.sync_control().paused
    registry.remove(redis_client, worker.worker_id)


class _ContendedLock:
    """A reentrant lock that says when a thread other than its holder asks for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.holder: threading.Thread | None = None
        self.contended = threading.Event()

    def __enter__(self) -> _ContendedLock:
        if self.holder is not None and threading.current_thread() is not self.holder:
            self.contended.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_read_crossing_the_other_threads_push_is_not_refused_as_a_replay(
    redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The listener and the work loop both follow the state. One of them waits for the control
    # lock while the other applies a push: what it reads must be at least what was applied, not
    # a record from before the push, refused as a replay with a warning about a Redis failover.
    engine = FakeEngine()
    worker = RolloutWorker(redis_client, engine, control_poll_s=0.2)
    lock = worker.control._lock = _ContendedLock()  # type: ignore[assignment]
    client = pipeline.Client(redis_client)
    read: list[int] = []
    with lock:  # this thread holds the lock, as the work loop does while it follows a push
        lock.holder = threading.current_thread()
        other = threading.Thread(target=lambda: read.append(worker.sync_control().generation))
        other.start()  # the listener, woken before the push
        assert lock.contended.wait(timeout=60)
        client.push_weights("/ckpt/v1", version=1, timeout=5)  # no live worker: returns at once
        assert worker.sync_control().generation == 1 and engine.updates == [("/ckpt/v1", 1)]
    other.join(timeout=60)
    assert read == [1] and engine.updates == [("/ckpt/v1", 1)]
    assert "refused" not in caplog.text


# -- real worker processes, hf engine --------------------------------------------------------------


def _heartbeats(conn: redis.Redis, count: int = 2) -> None:
    """Until every live worker has published its registry entry `count` more times: a window for a
    negative check measured in the workers' own progress (a loaded machine slows both alike)."""
    seen = {w.worker_id: {w.heartbeat_at} for w in registry.live_workers(conn)}

    def beaten() -> bool:
        for info in registry.live_workers(conn):
            seen.setdefault(info.worker_id, set()).add(info.heartbeat_at)
        return all(len(beats) > count for beats in seen.values())

    wait_until(beaten, 60, f"{count} more heartbeats of every worker")


def _live(conn: redis.Redis, count: int, timeout: float = 900) -> list[str]:
    wait_until(lambda: len([w for w in registry.live_workers(conn) if w.state != "starting"]) >= count, timeout,
           f"{count} live workers")
    return sorted(w.worker_id for w in registry.live_workers(conn))


def test_push_pause_resume_and_a_late_worker(
    redis_client: redis.Redis, start_worker: Callable[..., subprocess.Popen], v1_model_dir: Path, tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    start_worker(*FAST_BEATS)
    [first] = _live(redis_client, 1)

    result = client.push_weights(str(v1_model_dir), version=1, timeout=300)
    assert [(a.worker, a.version, a.ok) for a in result.acks] == [(first, 1, True)]

    # A worker started after the push comes up at v1 (acknowledged) before its first job.
    start_worker(*FAST_BEATS)
    workers = _live(redis_client, 2)
    [late] = [w for w in workers if w != first]
    wait_until(lambda: late in control_channel.read_acks(redis_client, 1), 60, "the late worker's ack")
    assert control_channel.read_acks(redis_client, 1)[late].ok
    assert {w.worker_id: w.weight_version for w in client.workers()} == {first: 1, late: 1}

    batch = client.submit([{**REQUEST, "id": f"r{i}"} for i in range(4)], run="after", output=output,
                          batch_size=1)
    assert batch.wait(timeout=300).counts["finished"] == 4
    assert set(batch.read().column("weight_version").to_pylist()) == {1}

    # Pause: idle workers (blocked in their dequeue) hand a new job back and wait.
    client.pause()
    wait_until(lambda: {w.state for w in client.workers()} == {"paused"}, 60, "every worker paused")
    held = client.submit([REQUEST], run="held", output=output)
    _heartbeats(redis_client)
    assert _queued(redis_client) == held.job_ids
    assert held.status().counts["finished"] == 0
    assert {w.state for w in client.workers()} == {"paused"}
    client.resume()
    assert held.wait(timeout=300).counts["finished"] == 1
    assert held.read().column("weight_version").to_pylist() == [1]


def test_a_push_no_worker_loads_changes_nothing(
    redis_client: redis.Redis, start_worker: Callable[..., subprocess.Popen], pipeline_env: dict[str, str],
    tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    start_worker(*FAST_BEATS)
    start_worker(*FAST_BEATS)
    workers = _live(redis_client, 2)
    missing = tmp_path / "not-a-checkpoint"  # a directory (a missing path is refused before the push)
    missing.mkdir()
    for _ in range(2):  # the version is not used up: the same push fails the same way again
        push = subprocess.run([*PIPELINE, "weights", "push", str(missing), "--version", "1", "--timeout", "300"],
                              env=pipeline_env, capture_output=True, text=True, timeout=600)
        assert push.returncode == 1, push.stdout + push.stderr
        assert "2 worker(s) failed" in push.stderr
        assert all(f"{w}: failed:" in push.stderr for w in workers)
        assert "nothing changed, the pool's weights are still v0" in push.stderr
        acks = control_channel.read_acks(redis_client, 1)
        assert sorted(acks) == workers and not any(a.ok for a in acks.values())
        assert all("no config.json" in (a.error or "") for a in acks.values())

    status = json.loads(subprocess.run([*PIPELINE, "status", "--json"], env=pipeline_env, capture_output=True,
                                       text=True, check=True).stdout)["pools"]["default"]
    desired = status["desired"]
    assert (desired["weight_version"], desired["weight_path"]) == (0, None)
    wait_until(lambda: {(w.state, w.weight_version, w.error) for w in client.workers()} == {("idle", 0, None)},
               60, "the workers back to serving v0")

    # The pool still serves v0, so jobs run on it; nobody serves v1.
    needs_v1 = client.submit([REQUEST], run="needs", output=f"file://{tmp_path}", min_weight_version=1)
    any_version = client.submit([REQUEST], run="any", output=f"file://{tmp_path}")
    assert any_version.wait(timeout=300).counts["finished"] == 1
    assert any_version.read().column("weight_version").to_pylist() == [0]
    _heartbeats(redis_client)
    assert needs_v1.status().counts["finished"] == 0


def test_a_worker_that_failed_a_push_serves_nothing_until_it_converges(
    redis_client: redis.Redis, start_worker: Callable[..., subprocess.Popen], pipeline_env: dict[str, str],
    v1_model_dir: Path, tmp_path: Path,
) -> None:
    client = pipeline.Client(redis_client)
    output = f"file://{tmp_path}"
    allowed = tmp_path / "allowed"
    fine = start_worker()
    [fine_id] = _live(redis_client, 1)
    start_worker(env={"PIPELINE_ALLOWED_WEIGHT_PREFIXES": str(allowed)})  # refuses weights elsewhere
    [picky] = [w for w in _live(redis_client, 2) if w != fine_id]

    with pytest.raises(pipeline.WeightPushError) as info:
        client.push_weights(str(v1_model_dir), version=1, timeout=300)
    assert list(info.value.failed) == [picky] and "the push stands" in str(info.value)
    assert client.control_state().weight_version == 1  # one worker took it: the fleet's weights are v1
    wait_until(lambda: {w.worker_id: (w.state, w.weight_version) for w in client.workers()}[picky]
               == ("unhealthy", 0), 60, "the failed worker unhealthy")
    weights = subprocess.run([*PIPELINE, "weights", "status", "--json"], env=pipeline_env, capture_output=True,
                             text=True, timeout=300)
    assert weights.returncode == 1, weights.stderr  # not every worker serves the desired weights
    report = json.loads(weights.stdout)
    assert report["desired"]["weight_version"] == 1 and report["desired"]["weight_path"] == str(v1_model_dir)
    by_worker = {w["worker_id"]: w for w in report["workers"]}
    assert (by_worker[fine_id]["weight_version"], by_worker[fine_id]["converged"]) == (1, True)
    assert (by_worker[picky]["weight_version"], by_worker[picky]["converged"]) == (0, False)
    assert "refused" in by_worker[picky]["error"]

    # Only the worker at v1 serves; with it gone, the failed one hands plain jobs back and
    # serves only a job that says it may run on older weights.
    batch = client.submit([{**REQUEST, "id": f"r{i}"} for i in range(4)], run="v1", output=output, batch_size=1)
    assert batch.wait(timeout=300).counts["finished"] == 4
    assert set(batch.read().column("weight_version").to_pylist()) == {1}
    fine.terminate()
    fine.wait(timeout=300)
    plain = client.submit([REQUEST], run="plain", output=output)
    old_ok = client.submit([REQUEST], run="old-ok", output=output, min_weight_version=0)
    assert old_ok.wait(timeout=300).counts["finished"] == 1
    assert old_ok.read().column("weight_version").to_pylist() == [0]
    assert plain.status().counts["finished"] == 0

    # A worker started now cannot load the pool's weights either: it does not join.
    refused = subprocess.run([*PIPELINE, "worker", "--model", str(v1_model_dir), "--burst"],
                             env={**pipeline_env, "PIPELINE_ALLOWED_WEIGHT_PREFIXES": str(allowed)},
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "does not join pool 'default'" in refused.stderr, refused.stderr

    # Recovery: the same weights where the failed worker may read them, re-pushed with --force.
    shutil.copytree(v1_model_dir, allowed / "v1")
    recovered = client.push_weights(str(allowed / "v1"), version=1, timeout=300, force=True)
    assert [(a.worker, a.ok) for a in recovered.acks] == [(picky, True)]
    assert plain.wait(timeout=300).counts["finished"] == 1
    assert plain.read().column("weight_version").to_pylist() == [1]
    assert {w.worker_id: (w.state, w.weight_version) for w in client.workers()}[picky] in {("idle", 1),
                                                                                           ("busy", 1)}
