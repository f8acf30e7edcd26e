"""Adapter pushes (docs/adapters.md): a PEFT adapter directory or a peft model into the pool's
adapter store as the next version, published in the registry; bad input refused, naming what."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from safetensors.numpy import load_file, save_file

import pipeline
from pipeline.core import adapters
from pipeline.core.broker import registry
from pipeline.core.errors import AdapterError
from pipeline.core.weights.store import WeightStore
from schemas.worker_info import WorkerInfo
from tests.helpers.adapters import build_adapter, lora_model, push_racing


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_pushes_of_a_directory_are_versions_of_the_name(redis_client: redis.Redis, tiny_model_dir: Path,
                                                        tmp_path: Path, home: Path) -> None:
    client = pipeline.Client(redis_client, pool="p")
    first = client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "a1", seed=1), base=tiny_model_dir)
    second = client.push_adapter("sql", build_adapter(tiny_model_dir, tmp_path / "a2", seed=2), base=tiny_model_dir)
    assert (first.version, second.version, first.current, second.current) == (1, 2, True, True)
    [record] = client.adapters().values()
    assert (record.name, record.version, record.rank, record.target_modules) == ("sql", 2, 4, ["q_proj", "v_proj"])
    assert record.url == f"file://{home}/weights/p/adapters/sql"
    store = WeightStore(record.url)
    assert store.versions() == [1, 2]
    stored = {t.name: t for t in store.manifest(2).tensors}
    saved = load_file(tmp_path / "a2" / "adapter_model.safetensors")
    assert set(stored) == set(saved)
    for name, array in saved.items():
        assert np.array_equal(store.tensor(2, name).words.view(np.float32).reshape(array.shape), array)
    model_bytes = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    assert record.stored_bytes < model_bytes / 10  # an adapter push moves a small share of the model


def test_a_peft_model_in_memory_is_pushed_as_its_directory_would_be(redis_client: redis.Redis,
                                                                   tiny_model_dir: Path, tmp_path: Path,
                                                                   home: Path) -> None:
    client = pipeline.Client(redis_client)
    model = lora_model(tiny_model_dir, seed=3)
    model.save_pretrained(tmp_path / "saved")
    result = pipeline.push_adapter(client, model, "math", base=str(tiny_model_dir))
    client.push_adapter("math-dir", tmp_path / "saved", base=tiny_model_dir)
    records = client.adapters()
    memory, disk = (WeightStore(records[n].url) for n in ("math", "math-dir"))
    assert result.version == 1
    assert {t.name: t.xxh3 for t in memory.manifest(1).tensors} == {t.name: t.xxh3 for t in disk.manifest(1).tensors}


def _base_with(tiny_model_dir: Path, path: Path, change: dict[str, np.ndarray | None]) -> Path:
    """A copy of the tiny model's tensors with some replaced (None: left out)."""
    path.mkdir()
    tensors = {**load_file(next(tiny_model_dir.glob("*.safetensors"))), **change}
    save_file({k: v for k, v in tensors.items() if v is not None}, path / "model.safetensors")
    return path


def test_an_adapter_that_does_not_fit_the_base_is_refused_naming_the_module(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, home: Path) -> None:
    client = pipeline.Client(redis_client)
    adapter = build_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    wider = _base_with(tiny_model_dir, tmp_path / "wider",
                       {"model.layers.1.self_attn.q_proj.weight": np.zeros((24, 32), np.float32)})
    with pytest.raises(AdapterError, match=r"module model\.layers\.1\.self_attn\.q_proj: lora_B has 32 out features"):
        client.push_adapter("sql", adapter, base=wider)
    no_v = _base_with(tiny_model_dir, tmp_path / "no-v", {f"model.layers.{i}.self_attn.v_proj.weight": None
                                                         for i in range(2)})
    with pytest.raises(AdapterError, match="target module 'v_proj' is not in the base model"):
        client.push_adapter("sql", adapter, base=no_v)
    assert client.adapters() == {}  # nothing published


def test_a_directory_that_is_not_a_peft_adapter_is_refused(redis_client: redis.Redis, tiny_model_dir: Path,
                                                           tmp_path: Path, home: Path) -> None:
    client = pipeline.Client(redis_client)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json and no adapter_model\.safetensors"):
        client.push_adapter("sql", tmp_path, base=tiny_model_dir)
    adapter = build_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(AdapterError, match="a 'IA3' adapter; only LoRA adapters"):
        client.push_adapter("sql", adapter, base=tiny_model_dir)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="adapter name 'my sql'"):
        client.push_adapter("my sql", adapter, base=tiny_model_dir)
    assert client.adapters() == {}


def test_racing_pushes_of_one_name_get_distinct_versions_and_the_newer_stays_current(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, home: Path) -> None:
    client = pipeline.Client(redis_client)
    dirs = [build_adapter(tiny_model_dir, tmp_path / f"a{i}", seed=i) for i in range(4)]
    results = push_racing(client, "sql", dirs, tiny_model_dir)
    assert sorted(r.version for r in results) == [1, 2, 3, 4]
    assert client.adapters()["sql"].version == 4
    assert WeightStore(client.adapters()["sql"].url).versions() == [1, 2, 3, 4]
    assert next(r for r in results if r.version == 4).current
    older = client.adapters()["sql"].model_copy(update={"version": 2})
    assert adapters.publish(redis_client, None, older) is False  # a late publish of an older version
    assert client.adapters()["sql"].version == 4


def test_a_push_keeps_the_last_versions_and_any_a_live_worker_holds(
        redis_client: redis.Redis, tiny_model_dir: Path, tmp_path: Path, home: Path) -> None:
    """A run that pushes its adapter every step keeps the store small: each current push prunes to the
    last `keep` versions, except a version a live worker holds resident (a job running on it may read
    it again); `keep=0` keeps every version."""
    client = pipeline.Client(redis_client)
    adapter = build_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    now = time.time()
    registry.publish(redis_client, WorkerInfo(worker_id="w0", host="h", pid=1, engine="sim", model="m",
                                              started_at=now, heartbeat_at=now, adapters=["sql@v1", "math@v2"]))
    pruned = [client.push_adapter("sql", adapter, base=tiny_model_dir, keep=2).pruned for _ in range(5)]
    assert pruned == [[], [], [], [2], [3]]  # v1 is resident on w0
    store = WeightStore(client.adapters()["sql"].url)
    assert store.versions() == [1, 4, 5]
    assert client.push_adapter("sql", adapter, base=tiny_model_dir, keep=0).pruned == []
    assert store.versions() == [1, 4, 5, 6]
    with pytest.raises(AdapterError, match=r"keep must be 0 \(every version\) or more versions, not -1"):
        client.push_adapter("sql", adapter, base=tiny_model_dir, keep=-1)
