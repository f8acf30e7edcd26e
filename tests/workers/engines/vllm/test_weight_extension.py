"""The vLLM weight extension's store side without vLLM: the plan the adapter builds from a real store
(`store_plan`), applied by the extension's code to its copy of the weights (`apply_steps`), checked
against every checksum. The server-side half (feeding vLLM, reading back) is
`test_vllm_store_server.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.core.weights.safetensors_io import TensorBits
from pipeline.core.weights.store import WeightStore
from pipeline.weights.writer import write_version
from workers.engines.vllm import weight_extension
from workers.engines.vllm.http_engine import store_plan


def version(seed: int, base: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """float32 tensors as words: random, or `base` with a few elements of each tensor moved."""
    rng = np.random.default_rng(seed)
    if base is None:
        return {f"layer.{i}.weight": rng.standard_normal(4096).astype(np.float32).view(np.uint32) for i in range(3)}
    out = {name: words.copy() for name, words in base.items()}
    for words in list(out.values())[:2]:
        floats = words.view(np.float32)
        floats[rng.integers(0, floats.size, 50)] += 1e-3
    return out


def bits(tensors: dict[str, np.ndarray]) -> list[TensorBits]:
    return [TensorBits(name, "F32", (words.size,), words) for name, words in tensors.items()]


def store_with_three_versions(tmp_path: Path) -> tuple[WeightStore, list[dict[str, np.ndarray]]]:
    store = WeightStore(f"file://{tmp_path}/store")
    versions = [version(0)]
    versions += [version(1, versions[0])]
    versions += [version(2, versions[1])]
    for number, tensors in enumerate(versions, start=1):
        write_version(store, bits(tensors), number)
    return store, versions


def test_a_delta_plan_brings_the_copy_to_the_new_version_bit_for_bit(tmp_path: Path) -> None:
    store, versions = store_with_three_versions(tmp_path)
    shadow: dict[str, np.ndarray] = {}
    full = json.loads(store_plan(store, None, 1))
    assert full["deltas"] is None and [s["version"] for s in full["chain"]] == [1]
    reader = weight_extension._Store(full["url"])
    assert weight_extension.apply_steps(shadow, full["chain"], reader) == set(versions[0])
    assert reader.bytes_read == store.manifest(1).stored_bytes
    assert not weight_extension.mismatched(shadow, full["final"])

    plan = json.loads(store_plan(store, 1, 3))
    assert [s["version"] for s in plan["deltas"]] == [2, 3]
    changed = weight_extension.apply_steps(shadow, plan["deltas"], weight_extension._Store(plan["url"]))
    assert changed == {"layer.0.weight", "layer.1.weight"}  # layer.2 is `same`: never fed to vLLM
    assert not weight_extension.mismatched(shadow, plan["final"])
    assert all(np.array_equal(shadow[name], words) for name, words in versions[2].items())


def test_a_corrupt_delta_is_caught_before_anything_is_fed(tmp_path: Path) -> None:
    store, _ = store_with_three_versions(tmp_path)
    shadow: dict[str, np.ndarray] = {}
    weight_extension.apply_steps(shadow, json.loads(store_plan(store, None, 1))["chain"],
                                 weight_extension._Store(store.url))
    plan = json.loads(store_plan(store, 1, 2))
    entry = next(e for e in plan["deltas"][0]["tensors"] if e["encoding"] != "same")
    blob = tmp_path / "store" / "v00000002" / entry["file"]
    data = bytearray(blob.read_bytes())
    data[entry["offset"] + entry["length"] // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    core = weight_extension.codec_core()
    try:
        weight_extension.apply_steps(shadow, plan["deltas"], weight_extension._Store(plan["url"]))
    except core.DecodeError as exc:
        assert entry["name"] in str(exc)
    else:
        assert entry["name"] in weight_extension.mismatched(shadow, plan["final"])


def test_the_extension_imports_nothing_of_the_pipeline_package() -> None:
    """vLLM's venv has no redis or pyarrow: the module and its codec core must load without `pipeline`."""
    code = ("import sys, workers.engines.vllm.weight_extension as w; w.codec_core(); "
            "assert 'pipeline' not in sys.modules, sorted(m for m in sys.modules if m.startswith('pipeline')); "
            "assert not any(m.startswith(('redis', 'pyarrow', 'pydantic')) for m in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parents[4])
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", ["F32", "BF16", "I64", "BOOL"])
def test_words_and_torch_tensors_round_trip(dtype: str) -> None:
    words = np.arange(12, dtype=weight_extension.codec_core().word_type(dtype))
    if dtype == "BOOL":
        words = words % 2
    tensor = weight_extension.to_torch(words, dtype, [3, 4])
    assert tuple(tensor.shape) == (3, 4)
    assert np.array_equal(weight_extension.to_words(tensor, dtype), words)


class FakeRunner:
    """vLLM's model runner as the extension uses it: `get_model`, and `reload_weights` taking
    checkpoint-named tensors, recorded: a readable parameter takes them in place; an emptied one
    (as vLLM's CPU build empties a packed linear weight) keeps them in `kernel`, as its packed copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.fed: list[list[str]] = []
        self.kernel: dict[str, torch.Tensor] = {}

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        names = []
        with torch.no_grad():
            for name, tensor in weights_iterator:
                param = self.model.get_parameter(name)
                if param.numel():
                    param.copy_(tensor)
                else:
                    self.kernel[name] = tensor.clone()
                names.append(name)
        self.fed.append(names)


class FakeWorker(weight_extension.RolloutWeightExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = FakeRunner(model)


PACKED = "layer.1.weight"  # emptied, as a linear weight on vLLM's CPU build: only reload_weights reaches it


def fake_worker() -> tuple[FakeWorker, torch.nn.Module]:
    """A worker whose model holds three tensors under their checkpoint names: two readable (zeros),
    one emptied (`PACKED`)."""
    layers = torch.nn.ModuleDict({str(i): torch.nn.Module() for i in range(3)})
    for i in range(3):
        layers[str(i)].weight = torch.nn.Parameter(torch.zeros(0 if i == 1 else 4096), requires_grad=False)
    model = torch.nn.Module()
    model.layer = layers
    return FakeWorker(model), model


def holds(worker: FakeWorker, tensors: dict[str, np.ndarray]) -> bool:
    """The fake vLLM computes with `tensors`: the readable ones in place, the packed one as last fed."""
    runner = worker.model_runner
    served = {name: (runner.kernel.get(name, torch.zeros(0)) if name == PACKED else runner.model.get_parameter(name))
              for name in tensors}
    return all(np.array_equal(served[n].numpy().view(np.uint32), w) for n, w in tensors.items())


def test_the_worker_side_copies_or_feeds_changed_tensors_reads_back_and_falls_back_to_full(tmp_path: Path) -> None:
    """The extension's whole call on a worker whose model holds the tensors under their checkpoint
    names: a full load, a delta that reaches only the changed tensors (a readable one copied in
    place, an emptied one fed to vLLM's reload), a corrupt delta answered by a full rebuild (said
    why), and answers, never exceptions, for what it cannot do."""
    store, versions = store_with_three_versions(tmp_path)
    worker, _ = fake_worker()

    first = worker.rollout_apply_store(store_plan(store, None, 1))
    assert (first["ok"], first["how"], first["checked_in_engine"], first["not_readable_in_engine"]) == \
        (True, "full", 2, 1)
    assert (first["tensors_copied"], first["tensors_fed"], first["layers_swapped"]) == (2, 1, 0)
    assert holds(worker, versions[0])
    delta = worker.rollout_apply_store(store_plan(store, 1, 2))
    assert (delta["ok"], delta["how"], delta["bytes_read"]) == (True, "delta", store.manifest(2).stored_bytes)
    assert (delta["tensors_copied"], worker.model_runner.fed[-1]) == (1, [PACKED])  # layer.2 did not change
    served = worker.rollout_weight_checksums()
    readable = {name: value for name, value in served["engine"].items() if value is not None}
    assert served["version"] == 2 and readable == {n: served["shadow"][n] for n in ("layer.0.weight", "layer.2.weight")}
    assert holds(worker, versions[1])

    plan = json.loads(store_plan(store, 2, 3))
    for step in plan["deltas"]:  # a delta the store cannot give: the copy is rebuilt from the full version
        step["tensors"] = [{**e, "length": 1} if e["encoding"] != "same" else e for e in step["tensors"]]
    rebuilt = worker.rollout_apply_store(json.dumps(plan))
    assert (rebuilt["ok"], rebuilt["how"]) == (True, "full") and "rebuilt from the full version" in rebuilt["detail"]
    assert holds(worker, versions[2])

    broken = worker.rollout_apply_store("{not json")
    assert broken["ok"] is False and "JSONDecodeError" in broken["error"]
    assert worker.rollout_forget_store() == {"ok": True}
    assert worker.rollout_weight_checksums()["version"] is None


def fake_worker_at_v1(store: WeightStore) -> FakeWorker:
    worker, _ = fake_worker()
    assert worker.rollout_apply_store(store_plan(store, None, 1))["ok"]
    return worker


def staged(worker: FakeWorker) -> dict[str, Any]:
    """`rollout_staged`'s answer once the staging thread has ended (joined: no polling in the test)."""
    worker._rollout_state()["staging"]["thread"].join(timeout=60)
    return worker.rollout_staged()


def test_a_staged_version_reaches_vllm_only_when_installed(tmp_path: Path) -> None:
    """Staging decodes and checks on a thread and answers at once; vLLM's weights change only at
    the install, which feeds the changed layers; the next delta starts from the installed version."""
    store, versions = store_with_three_versions(tmp_path)
    worker = fake_worker_at_v1(store)
    assert worker.rollout_stage_store(store_plan(store, 1, 2)) == {"ok": True, "version": 2}
    done = staged(worker)
    assert (done["ok"], done["done"], done["how"], set(done["seconds"])) == (True, True, "delta", {"decode", "pack"})
    assert holds(worker, versions[0]) and worker.model_runner.fed == [[PACKED]]  # vLLM untouched so far
    installed = worker.rollout_install_store(2)
    assert (installed["ok"], installed["how"]) == (True, "delta")
    assert installed["bytes_read"] == store.manifest(2).stored_bytes
    assert set(installed["seconds"]) == {"decode", "pack", "load", "check"}
    assert worker.model_runner.fed[-1] == [PACKED] and holds(worker, versions[1])
    assert worker.rollout_weight_checksums()["version"] == 2

    worker.rollout_stage_store(store_plan(store, 2, 3))
    assert staged(worker)["how"] == "delta"
    assert worker.rollout_install_store(3)["ok"] and holds(worker, versions[2])


def test_a_staging_never_installed_leaves_vllm_as_it_was_and_the_next_plan_rebuilds(tmp_path: Path) -> None:
    """A push given up between staging and install: vLLM keeps v1, an install of another version is
    refused with an answer, and the next plan cannot start from the half-moved copy, so it rebuilds."""
    store, versions = store_with_three_versions(tmp_path)
    worker = fake_worker_at_v1(store)
    worker.rollout_stage_store(store_plan(store, 1, 2))
    staged(worker)
    refused = worker.rollout_install_store(3)
    assert refused["ok"] is False and "v3 is not staged here (v2 is staged)" in refused["error"]
    assert holds(worker, versions[0])
    worker.rollout_stage_store(store_plan(store, 1, 3))  # the worker still thinks it serves v1
    done = staged(worker)
    assert done["how"] == "full"
    installed = worker.rollout_install_store(3)
    assert installed["how"] == "full" and "no version of this store loaded" in installed["detail"]
    assert holds(worker, versions[2])
    assert worker.rollout_install_store(3)["ok"] is False  # installed once: nothing is staged now


def test_a_corrupt_store_is_refused_at_staging_with_vllm_untouched(tmp_path: Path) -> None:
    store, versions = store_with_three_versions(tmp_path)
    worker = fake_worker_at_v1(store)
    plan = json.loads(store_plan(store, 1, 2))
    plan["final"][0]["xxh3"] = "0" * 32  # no way to reach these bits: the store is corrupt
    worker.rollout_stage_store(json.dumps(plan))
    done = staged(worker)
    assert (done["ok"], done["done"]) == (False, True) and "the store is corrupt" in done["error"]
    assert worker.rollout_install_store(2)["ok"] is False
    assert holds(worker, versions[0]) and len(worker.model_runner.fed) == 1
