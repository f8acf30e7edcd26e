"""Pushes through a weight store, end to end on the real Redis: a trainer's state dict (no checkpoint
directory anywhere) pushed as deltas lands bit for bit in the hf engine, the rows it then generates
are the new version's (teacher forcing agrees), a late worker rebuilds from the full version plus
the deltas, and a checkpoint directory goes the same road through `pipeline weights push --delta`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

import pipeline
from pipeline.core.broker import control_channel, registry
from pipeline.core.weights.store import WeightStore
from tests.conftest import PIPELINE
from tests.helpers.processes import drive_worker, wait_until
from tests.helpers.weights_trainer import Trainer, corrupt_a_delta, same_bits
from workers.engines.hf.engine import HFEngine

REQUESTS = [{"id": f"r{i}", "input_ids": [3 + i, 7, 9], "sampling_params": {"max_new_tokens": 12, "seed": i}}
            for i in range(4)]
SAME_WEIGHTS = 1e-3


def test_delta_pushes_from_a_state_dict_land_bit_for_bit_and_rows_match_the_new_version(
    redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    client = pipeline.Client(redis_client)
    trainer = Trainer(tiny_model_dir)
    store = f"file://{tmp_path}/store"
    engine = HFEngine(tiny_model_dir)
    pushes: list = []
    seen: dict[str, bool] = {}

    def driver() -> None:
        wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 30, "an idle worker")
        for version in (1, 2, 3):
            trainer.step()
            pushes.append(client.push_weights(state_dict=trainer.model.state_dict(), version=version, store=store,
                                              timeout=60, mode="partial"))
            seen[f"v{version}"] = same_bits(engine.model.state_dict(), trainer.model.state_dict())
        batch = client.submit(REQUESTS, run="after", output=f"file://{tmp_path}/out", min_weight_version=3)
        batch.wait(timeout=60)

    drive_worker(redis_client, engine, driver, stop_when_done=True)
    assert seen == {"v1": True, "v2": True, "v3": True}
    assert [p.kind for p in pushes] == ["full", "delta", "delta"]
    acks = [p.acks[0] for p in pushes]
    assert [a.applied for a in acks] == ["full", "delta", "delta"]
    assert "no version of this store loaded" in (acks[0].detail or "") and acks[1].detail is None
    # A worker reads what the push stored: the whole model once, then each delta only.
    assert [a.bytes_read for a in acks] == [p.stored_bytes for p in pushes]
    assert all(p.stored_bytes < p.model_bytes for p in pushes[1:])
    # The ack says how long reading and staging took before the pause, not only the pause (issue 45).
    assert all(a.prepare_seconds > 0 for a in acks)
    # Nothing large went through Redis: the state names the store and the version.
    state = control_channel.read_state(redis_client)
    assert (state.weight_source, state.weight_path, state.weight_version) == ("store", store, 3)

    rows = f"{tmp_path}/out/after"
    assert set(pipeline.read_rollouts(rows).column("weight_version").to_pylist()) == {3}
    v3 = trainer.save(tmp_path / "v3")
    assert pipeline.verify(rows, v3).max_abs_diff <= SAME_WEIGHTS
    assert pipeline.verify(rows, str(tiny_model_dir)).max_abs_diff > 0.05  # the check can tell versions apart


def test_a_delta_over_drifted_weights_falls_back_to_a_full_rebuild(tiny_model_dir: Path, tmp_path: Path) -> None:
    from pipeline.core.weights.torch_bits import state_dict_bits
    from pipeline.weights.writer import write_version

    trainer = Trainer(tiny_model_dir)
    store = WeightStore(str(tmp_path / "store"))
    engine = HFEngine(tiny_model_dir)
    write_version(store, state_dict_bits(trainer.model.state_dict()), 1)
    assert engine.apply_store_version(store, None, 1).how == "full"
    trainer.step()
    write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    with torch.no_grad():  # the engine no longer holds v1 exactly (a bug, a stray write)
        engine.model.state_dict()["model.norm.weight"][0] += 1.0
    applied = engine.apply_store_version(store, 1, 2)
    assert applied.how == "full" and "model.norm.weight" in (applied.detail or "")
    assert same_bits(engine.model.state_dict(), trainer.model.state_dict()) and engine.weight_version == 2


def test_a_corrupt_delta_is_refused_and_the_engine_keeps_its_version_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from pipeline.core.weights.torch_bits import state_dict_bits
    from pipeline.weights.writer import write_version
    from workers.engines.inplace import WeightsMismatchError

    trainer = Trainer(tiny_model_dir)
    store = WeightStore(str(tmp_path / "store"))
    engine = HFEngine(tiny_model_dir)
    write_version(store, state_dict_bits(trainer.model.state_dict()), 1)
    engine.apply_store_version(store, None, 1)
    v1 = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    trainer.step()
    written = write_version(store, state_dict_bits(trainer.model.state_dict()), 2)
    entry = corrupt_a_delta(tmp_path / "store", written.manifest)  # the delta's bytes lost on disk
    with pytest.raises(WeightsMismatchError, match=rf"{entry.name}.*the engine is back at v1, bit for bit"):
        engine.apply_store_version(WeightStore(str(tmp_path / "store")), 1, 2)
    assert same_bits(engine.model.state_dict(), v1) and engine.weight_version == 1


def test_a_late_worker_rebuilds_from_full_and_deltas_and_the_cli_pushes_a_checkpoint_as_a_delta(
    redis_url: str, pipeline_env: dict[str, str], start_worker: Callable[..., subprocess.Popen], tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    conn = redis.Redis.from_url(redis_url)
    client = pipeline.Client(conn)
    trainer = Trainer(tiny_model_dir)
    store = f"file://{tmp_path}/store"
    start_worker()
    wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 60, "the first worker idle")
    kinds = []
    for version in (1, 2, 3, 4):  # full, delta, full, delta: pruning keeps v3 and v4 once both workers serve v4
        trainer.step()
        pushed = client.push_weights(state_dict=trainer.model.state_dict(), version=version, store=store,
                                     full_every=2, timeout=120)
        kinds.append((pushed.kind, pushed.acks[0].applied))  # type: ignore[attr-defined]
    # The full v3 carries its delta against v2, which the worker serving v2 applies.
    assert kinds == [("full", "full"), ("delta", "delta"), ("full", "delta"), ("delta", "delta")]
    assert WeightStore(store).versions() == [3, 4]

    start_worker()  # joins at v4: rebuilt from the full v3 and the delta v4
    wait_until(lambda: len(control_channel.read_acks(conn, 4)) == 2, 60, "the late worker's acknowledgement")
    late = [a for a in control_channel.read_acks(conn, 4).values() if a.applied == "full"]
    full_bits = sum(t.length for t in WeightStore(store).manifest(3).tensors)  # not the delta v3 carries
    assert len(late) == 1 and late[0].ok
    assert late[0].bytes_read == full_bits + WeightStore(store).manifest(4).stored_bytes
    wait_until(lambda: sorted(w.weight_version for w in client.workers()) == [4, 4], 30, "both workers at v4")

    # v5 from a checkpoint directory through the CLI, as a delta; both workers apply it in place.
    trainer.step()
    v5 = trainer.save(tmp_path / "v5")
    out = subprocess.run([*PIPELINE, "weights", "push", v5, "--version", "5", "--delta", "--store", store],
                         env=pipeline_env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert f"via {store} (delta:" in out.stdout and out.stdout.count(", delta, ") == 2
    status = subprocess.run([*PIPELINE, "weights", "status"], env=pipeline_env, capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0 and f"weight store {store}: v3 full" in status.stdout and "v5 delta" in status.stdout

    requests = [{**r, "id": f"{r['id']}-{copy}"} for r in REQUESTS for copy in range(2)]
    batch = client.submit(requests, run="late", output=f"file://{tmp_path}/out", batch_size=1,
                          min_weight_version=5)
    batch.wait(timeout=120)
    rows = f"{tmp_path}/out/late"
    assert set(pipeline.read_rollouts(rows).column("weight_version").to_pylist()) == {5}
    assert pipeline.verify(rows, v5).max_abs_diff <= SAME_WEIGHTS
    assert {w.weight_version for w in registry.live_workers(conn)} == {5}


def test_an_engine_that_loads_only_from_disk_and_has_no_model_directory_refuses_a_store_push(
    redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "state"))
    from pipeline.core.errors import WeightPushError
    from workers.engines.fake import FakeEngine

    client = pipeline.Client(redis_client)
    store = f"file://{tmp_path}/store"
    state_dict = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    errors: list[WeightPushError] = []

    def driver() -> None:
        wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 30, "an idle worker")
        with pytest.raises(WeightPushError) as raised:
            client.push_weights(state_dict=state_dict, version=1, store=store, timeout=30)
        errors.append(raised.value)

    drive_worker(redis_client, FakeEngine(), driver, stop_when_done=True)
    [error] = errors
    # It would load the version materialised as a checkpoint, which needs the served model's config.
    assert "the model the engine serves (fake-model) has no config.json readable here" in str(error)
    assert error.rolled_back is not None and control_channel.read_state(redis_client).weight_version == 0
    assert WeightStore(store).versions() == []  # nobody took v1: it is gone, and v1 can be pushed again


def test_an_engine_that_loads_only_from_disk_takes_each_store_version_in_full_and_says_so(
    redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.workers.engines.conftest import launch, stop, wait_ready
    from workers.engines.sglang.http_engine import SGLangHTTPEngine

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "state"))
    client = pipeline.Client(redis_client)
    trainer = Trainer(tiny_model_dir)
    store = f"file://{tmp_path}/store"
    pushes: list = []

    def driver() -> None:
        wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 60, "an idle worker")
        for version in (1, 2):
            trainer.step()
            pushes.append(client.push_weights(state_dict=trainer.model.state_dict(), version=version, store=store,
                                              timeout=120))
        client.submit(REQUESTS, run="after", output=f"file://{tmp_path}/out", min_weight_version=2).wait(timeout=120)

    server = launch(tiny_model_dir, tmp_path / "standin.log")  # a real HTTP server loading from disk
    try:
        wait_ready(server)
        drive_worker(redis_client, SGLangHTTPEngine([server.url]), driver, stop_when_done=True)
    finally:
        stop(server)
    assert [p.kind for p in pushes] == ["full", "delta"]
    acks = [p.acks[0] for p in pushes]
    assert [(a.ok, a.applied) for a in acks] == [(True, "full"), (True, "full")]
    assert all("the sglang-http engine cannot apply a delta in place" in (a.detail or "") for a in acks)
    # Rebuilt from the store each time: the full version, then the full version and the delta.
    assert [a.bytes_read for a in acks] == [pushes[0].stored_bytes, pushes[0].stored_bytes + pushes[1].stored_bytes]
    # The checkpoint the server loaded: the model's config beside the rebuilt tensors; v1's is gone.
    loaded = [p for p in (tmp_path / "state" / "materialised").glob("*/*") if p.is_dir()]
    assert [p.name for p in loaded] == ["v00000002"]
    assert {"config.json", "model.safetensors"} <= {f.name for f in loaded[0].iterdir()}

    rows = f"{tmp_path}/out/after"
    assert set(pipeline.read_rollouts(rows).column("weight_version").to_pylist()) == {2}
    assert pipeline.verify(rows, trainer.save(tmp_path / "v2")).max_abs_diff <= SAME_WEIGHTS
    assert pipeline.verify(rows, str(tiny_model_dir)).max_abs_diff > 0.05  # the check can tell versions apart
