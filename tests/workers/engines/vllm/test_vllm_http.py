"""The vllm-http engine over `httpx.MockTransport` replaying a real vLLM 0.32 server's answers
(tests/fixtures/vllm): start-up (model, logprobs mode, weight version), generation, refusals,
retries, weight reloads, pause/resume and aborts. The real server is driven end to end in
tests/workers/engines/vllm/test_vllm_*.py (the vllm test group)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.workers.engines.fake_vllm import URL, FakeVLLM, fixture, recorded, request_of
from workers.engines.base import INTERRUPTED, Finish
from workers.engines.factory import EngineOptions, build_engine
from workers.engines.http.client import RetryPolicy
from workers.engines.vllm.http_engine import DEV_MODE_ENV, VLLMHTTPEngine
from workers.errors import EngineUnavailableError, UnsupportedRequestError

FAST = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=0.002, down_cooldown_s=60.0)
B = "http://vllm-b:8000"


def start(server: FakeVLLM, urls: tuple[str, ...] = (URL,), **options: Any) -> VLLMHTTPEngine:
    return VLLMHTTPEngine(list(urls), retry=FAST, transport=server.transport(), **options)


def model_dir(root: Path, *, tied: bool) -> Path:
    """A model directory as the server and the worker see it: its config.json, its checkpoint."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied,
                                                  "vocab_size": 49152}))
    (root / "model.safetensors").write_bytes(b"weights")
    return root


@pytest.fixture
def served(tmp_path: Path) -> Path:
    return model_dir(tmp_path / "served", tied=False)


@pytest.fixture
def server(served: Path) -> FakeVLLM:
    return FakeVLLM(model_root=str(served))


@pytest.fixture
def engine(server: FakeVLLM) -> Iterator[VLLMHTTPEngine]:
    engine = start(server, max_top_logprobs=2, weight_version=4)
    yield engine
    engine.close()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return model_dir(tmp_path / "step-5", tied=False)


# -- start-up ----------------------------------------------------------------------------------


def test_start_reads_the_model_the_logprobs_mode_and_the_weight_version(server: FakeVLLM, served: Path,
                                                                         engine: VLLMHTTPEngine) -> None:
    assert engine.description.name == "vllm-http" and engine.description.model == str(served)
    assert engine.description.capabilities.max_top_logprobs == 2
    assert engine.description.capabilities.vocab_size == 49152  # the served model's config.json, read here
    assert not engine.description.capabilities.routed_experts
    assert engine.logprobs_mode == "processed_logprobs" and engine.dev_mode == {URL: True}
    assert engine.weight_version == 4  # the server says "default": the worker's own version stands
    assert "/server_info?config_format=json" in server.paths()
    assert not server.bodies("/v1/completions")  # the mode came from the configuration, not a probe


def test_a_tagged_server_weight_version_is_the_engines(server: FakeVLLM) -> None:
    server.weight_version = "7"
    engine = start(server)
    try:
        assert engine.weight_version == 7
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
def test_without_development_endpoints_a_probe_tells_the_logprobs_mode(mode: str) -> None:
    server = FakeVLLM(dev_mode=False, logprobs_mode=mode)
    engine = start(server, weight_version=2)
    try:
        assert engine.logprobs_mode == mode and engine.dev_mode == {URL: False}
        assert engine.weight_version == 2
        probes = server.bodies("/v1/completions")
        assert [b["temperature"] for b in probes] == [0.0, 2.0] and all(b["max_tokens"] == 1 for b in probes)
    finally:
        engine.close()


def test_servers_with_different_logprobs_modes_are_refused() -> None:
    modes = iter(["raw_logprobs", "processed_logprobs"])
    server = FakeVLLM()

    def info(body: Any) -> httpx.Response:
        server.logprobs_mode = next(modes)
        return server._server_info()

    server.overrides[("GET", "/server_info")] = info
    with pytest.raises(EngineUnavailableError, match="different --logprobs-mode"):
        start(server, urls=(URL, B))


def test_top_k_beyond_the_servers_max_logprobs_is_refused_at_start(server: FakeVLLM) -> None:
    with pytest.raises(EngineUnavailableError, match="--max-logprobs 20"):
        start(server, max_top_logprobs=21)


def test_an_unreachable_server_fails_the_start_naming_it() -> None:
    server = FakeVLLM()

    def down(body: Any) -> httpx.Response:
        raise httpx.ConnectError("refused")

    server.overrides[("GET", "/v1/models")] = down
    with pytest.raises(EngineUnavailableError, match=f"{URL}: cannot connect"):
        start(server)


def test_the_factory_and_cli_build_a_vllm_http_engine(server: FakeVLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli.main import build_parser
    from workers.commands.worker_options import engine_options

    with pytest.raises(EngineUnavailableError, match="needs at least one --url"):
        build_engine(EngineOptions(engine="vllm-http"))
    args = build_parser().parse_args(["worker", "--engine", "vllm-http", "--url", URL, "--max-top-logprobs", "2"])
    options = engine_options(args)
    assert options.engine == "vllm-http" and options.urls == (URL,)
    transport = server.transport()
    real_init = VLLMHTTPEngine.__init__
    monkeypatch.setattr(VLLMHTTPEngine, "__init__",
                        lambda self, urls, **kw: real_init(self, urls, transport=transport, **kw))
    engine = build_engine(options)
    try:
        assert isinstance(engine, VLLMHTTPEngine) and engine.description.capabilities.max_top_logprobs == 2
    finally:
        engine.close()


# -- generation --------------------------------------------------------------------------------


def test_generate_sends_token_ids_and_returns_the_recorded_completion(server: FakeVLLM,
                                                                      engine: VLLMHTTPEngine) -> None:
    server.completions = ["completion_stop_string"]
    request = request_of("completion_stop_string")
    [[sample]] = engine.generate([request])
    [body] = server.bodies("/v1/completions")
    assert body["prompt"] == request.input_ids and body["return_token_ids"] and body["stop"] == [" Paris"]
    assert body["request_id"].startswith("q-")
    assert sample.finish == Finish("stop", matched=" Paris")
    assert sample.token_ids.tolist() == fixture("completion_stop_string")["response"]["choices"][0]["token_ids"]


def test_seeded_n_goes_as_one_call_per_sample_and_comes_back_in_order(server: FakeVLLM,
                                                                      engine: VLLMHTTPEngine) -> None:
    server.completions = ["completion_length", "completion_eos"]
    request = request_of("completion_eos", sampling={"n": 2, "seed": 3, "temperature": 1.0})
    [samples] = engine.generate([request])
    assert [s.finish.kind for s in samples] == ["length", "stop"]
    assert [b["n"] for b in server.bodies("/v1/completions")] == [1, 1]


def test_a_request_the_server_cannot_serve_exactly_is_refused_before_anything_is_sent(
        server: FakeVLLM, engine: VLLMHTTPEngine) -> None:
    request = request_of("completion_top_k_processed")  # temperature 0.7, top_k 5, logprobs
    assert engine.description.served.filtered_logprobs is False  # registered: submit fails fast on it
    with pytest.raises(UnsupportedRequestError, match=r"cannot serve logprobs of top-k/top-p/min-p .*renormalise"):
        engine.generate([request_of("completion_eos", rid="fine"), request])
    assert not server.bodies("/v1/completions")
    future = engine.submit([request])
    with pytest.raises(UnsupportedRequestError):
        future.result(timeout=10)
    assert engine.load() == 0


def test_a_4xx_is_the_servers_refusal_in_its_words(server: FakeVLLM, engine: VLLMHTTPEngine) -> None:
    server.completions = [lambda body: recorded("error_token_beyond_vocab")]
    with pytest.raises(UnsupportedRequestError, match="Token id 49152 is out of vocabulary"):
        engine.generate([request_of("completion_eos")])


def test_5xx_and_connection_errors_are_retried_under_a_fresh_id_on_another_server() -> None:
    server = FakeVLLM()
    answers = iter([lambda body: httpx.Response(503, json={"error": {"message": "busy"}}),
                    lambda body: recorded("completion_eos")])

    def flaky(body: Any) -> Any:
        return next(answers)(body)

    server.completions = [flaky, flaky]
    engine = start(server, urls=(URL, B))
    try:
        [[sample]] = engine.generate([request_of("completion_eos")])
        assert sample.finish.kind == "stop"
        sends = [(u, b["request_id"]) for u, _, p, b in server.sent if p == "/v1/completions"]
        assert len(sends) == 2 and sends[0][0] != sends[1][0]  # the retry avoids the server that failed
        assert sends[1][1] == f"{sends[0][1]}-r1"
    finally:
        engine.close()


def test_concurrent_batches_share_the_servers_and_count_their_load(server: FakeVLLM,
                                                                   engine: VLLMHTTPEngine) -> None:
    release = asyncio.Event()
    loop = engine._bridge.loop

    async def held(body: Any) -> httpx.Response:
        await release.wait()
        return recorded("completion_eos")

    server.completions = [held, held, held]
    first = engine.submit([request_of("completion_eos", rid="a"), request_of("completion_eos", rid="b")])
    second = engine.submit([request_of("completion_eos", rid="c")])
    assert engine.load() == 3 and engine.capacity == 256
    loop.call_soon_threadsafe(release.set)
    assert len(first.result(timeout=10)) == 2 and len(second.result(timeout=10)) == 1
    assert engine.load() == 0


# -- lifecycle ---------------------------------------------------------------------------------


def test_a_weight_reload_pauses_reloads_resets_the_cache_tags_and_resumes(server: FakeVLLM, engine: VLLMHTTPEngine,
                                                                          checkpoint: Path) -> None:
    engine.update_weights(str(checkpoint), 5)
    lifecycle = [p for p in server.paths() if p.split("?")[0] in
                 ("/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")]
    assert lifecycle == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                         "/resume"]
    assert server.bodies("/collective_rpc") == [{"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(checkpoint)}}]
    assert server.bodies("/update_weight_version") == [{"new_version": "5"}]
    assert engine.weight_version == 5 and engine.weight_info() == {URL: "5"} and not server.paused


def test_a_path_vllm_cannot_load_is_refused_before_the_server_sees_it(server: FakeVLLM, engine: VLLMHTTPEngine,
                                                                      tmp_path: Path) -> None:
    # vLLM 0.32 answers a reload from a bad path with a 500 and its engine dies: never send one.
    before = len(server.sent)
    with pytest.raises(EngineUnavailableError, match="not a directory"):
        engine.update_weights(str(tmp_path / "missing"), 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineUnavailableError, match=r"no \*\.safetensors"):
        engine.update_weights(str(tmp_path / "empty"), 5)
    # vLLM 0.32's in-place reload skips a tied lm_head: the server would mix new and old weights.
    with pytest.raises(EngineUnavailableError, match=r"ties the word embeddings.*untied"):
        engine.update_weights(str(model_dir(tmp_path / "tied", tied=True)), 5)
    assert len(server.sent) == before and engine.weight_version == 4


def test_a_reload_of_a_server_serving_tied_embeddings_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    server = FakeVLLM(model_root=str(model_dir(tmp_path / "tied-served", tied=True)))
    engine = start(server)
    try:
        with pytest.raises(EngineUnavailableError, match=r"tied-served/config\.json ties the word embeddings"):
            engine.update_weights(str(checkpoint), 5)
        assert not server.bodies("/collective_rpc")
    finally:
        engine.close()


def test_a_failed_reload_resumes_the_servers_and_keeps_the_version(server: FakeVLLM, engine: VLLMHTTPEngine,
                                                                   checkpoint: Path) -> None:
    message = "Call to collective_rpc method failed: Worker failed with error 'boom'"
    server.overrides[("POST", "/collective_rpc")] = lambda body: httpx.Response(
        500, json={"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}})
    with pytest.raises(EngineUnavailableError, match=r"collective_rpc failed on .*Worker failed with error 'boom'"):
        engine.update_weights(str(checkpoint), 5)
    assert server.paths()[-1] == "/resume" and not server.paused
    assert engine.weight_version == 4 and not server.bodies("/update_weight_version")


def test_lifecycle_without_development_endpoints_names_the_switch(checkpoint: Path) -> None:
    server = FakeVLLM(dev_mode=False)
    engine = start(server)
    try:
        for call in (lambda: engine.update_weights(str(checkpoint), 1), engine.continue_generation,
                     lambda: engine.pause_generation("wait"), engine.interrupt, engine.abort_all):
            with pytest.raises(EngineUnavailableError, match=f"{DEV_MODE_ENV}=1"):
                call()
        engine.health()  # served without them
        assert engine.version() == {URL: "0.32.0"}
    finally:
        engine.close()


def test_pause_resume_and_cache_reset(server: FakeVLLM, engine: VLLMHTTPEngine) -> None:
    engine.pause_generation("keep")
    assert engine.is_paused() == {URL: True}
    engine.continue_generation()
    assert engine.is_paused() == {URL: False}
    with pytest.raises(ValueError, match="not one of"):
        engine.pause_generation("retract")
    server.overrides[("POST", "/reset_prefix_cache")] = lambda body: httpx.Response(200, json={"success": False})
    with pytest.raises(EngineUnavailableError, match="could not reset the prefix cache"):
        engine.flush_cache()
    assert "/pause?mode=keep" in server.paths()


def test_health_fails_when_a_servers_engine_is_dead(server: FakeVLLM) -> None:
    engine = start(server, urls=(URL, B))
    try:
        engine.health()
        server.overrides[("GET", "/health")] = lambda body: httpx.Response(503)
        with pytest.raises(EngineUnavailableError, match=r"GET /health failed on .*HTTP 503"):
            engine.health()
    finally:
        engine.close()


def test_interrupt_aborts_this_workers_requests_by_id_and_keeps_their_tokens(server: FakeVLLM,
                                                                             engine: VLLMHTTPEngine) -> None:
    aborted = asyncio.Event()
    started = asyncio.Event()
    loop = engine._bridge.loop

    async def until_aborted(body: Any) -> httpx.Response:
        loop.call_soon_threadsafe(started.set)
        await aborted.wait()
        return recorded("completion_aborted")

    def abort(body: Any) -> httpx.Response:
        loop.call_soon_threadsafe(aborted.set)
        return recorded("abort_requests_by_id")

    server.completions = [until_aborted]
    server.overrides[("POST", "/abort_requests")] = abort
    request = request_of("completion_aborted")
    future = engine.submit([request])
    asyncio.run_coroutine_threadsafe(started.wait(), loop).result(timeout=10)
    assert engine.interrupt() == 1
    [[sample]] = future.result(timeout=10)
    generated = fixture("completion_aborted")["response"]["choices"][0]["token_ids"]
    assert sample.finish == Finish("abort", message=INTERRUPTED) and sample.token_ids.tolist() == generated
    [sent] = server.bodies("/v1/completions")
    assert server.bodies("/abort_requests") == [{"request_ids": [f"cmpl-{sent['request_id']}-0"]}]
    assert engine.client.aborted == [f"cmpl-{sent['request_id']}-0"]


def test_an_abort_that_arrives_before_its_request_is_sent_again(server: FakeVLLM, engine: VLLMHTTPEngine) -> None:
    aborted = asyncio.Event()
    started = asyncio.Event()
    loop = engine._bridge.loop
    aborts: list[Any] = []

    async def until_aborted(body: Any) -> httpx.Response:
        loop.call_soon_threadsafe(started.set)
        await aborted.wait()
        return recorded("completion_aborted")

    def abort(body: Any) -> httpx.Response:
        aborts.append(body)
        if len(aborts) == 2:  # the first found nothing to stop: the request was still on its way in
            loop.call_soon_threadsafe(aborted.set)
        return recorded("abort_requests_by_id")

    server.completions = [until_aborted]
    server.overrides[("POST", "/abort_requests")] = abort
    engine.reabort_s = 0.05
    future = engine.submit([request_of("completion_aborted")])
    asyncio.run_coroutine_threadsafe(started.wait(), loop).result(timeout=10)
    assert engine.interrupt() == 1
    assert future.result(timeout=10)[0][0].finish.interrupted
    assert len(aborts) == 2 and aborts[0] == aborts[1]


def test_a_pause_that_fails_on_one_server_still_resumes_the_others(checkpoint: Path, served: Path) -> None:
    server = FakeVLLM(model_root=str(served))
    engine = start(server, urls=(URL, B))
    try:
        def pause(body: Any) -> httpx.Response:
            if server.sent[-1][0] == B:
                raise httpx.ConnectError("refused")
            return server._set_paused(True, "pause_wait")

        server.overrides[("POST", "/pause")] = pause
        with pytest.raises(EngineUnavailableError, match=f"POST /pause\\?mode=wait failed on {B}: cannot connect"):
            engine.update_weights(str(checkpoint), 5)
        assert (URL, "POST", "/resume", None) in server.sent and not server.paused
        assert not server.bodies("/collective_rpc") and engine.weight_version == 0
    finally:
        engine.close()


def extension_server(served: Path, answers: list[dict[str, Any]]) -> FakeVLLM:
    """A server whose workers run the project's weight extension (`/server_info` names it), each
    `/collective_rpc` answered with the next of `answers` (what `rollout_apply_store` returns)."""
    from workers.engines.vllm.http_engine import WEIGHT_EXTENSION

    server = FakeVLLM(model_root=str(served))
    info = fixture("server_info_json")["response"]
    info["vllm_config"]["model_config"]["logprobs_mode"] = "processed_logprobs"
    info["vllm_config"]["parallel_config"] = {"worker_extension_cls": WEIGHT_EXTENSION}
    server.overrides[("GET", "/server_info")] = lambda body: httpx.Response(200, json=info)
    server.overrides[("POST", "/collective_rpc")] = lambda body: httpx.Response(200, json={"results": [answers.pop(0)]})
    return server


def test_a_store_version_goes_through_the_extension_in_the_reload_pause(served: Path, tmp_path: Path) -> None:
    import numpy as np

    from pipeline.core.weights.safetensors_io import TensorBits
    from pipeline.core.weights.store import WeightStore
    from pipeline.weights.writer import write_version

    store = WeightStore(str(tmp_path / "store"))
    write_version(store, [TensorBits("w", "F32", (4,), np.arange(4, dtype=np.uint32))], 1)
    plain = start(FakeVLLM(model_root=str(served)))
    assert not hasattr(plain, "apply_store_version")  # no extension: a store push is materialised and reloaded
    plain.close()
    server = extension_server(served, [
        {"ok": True, "how": "full", "detail": "no version of this store loaded", "bytes_read": 16,
         "tensors_changed": 1},
        {"ok": False, "error": "after a full rebuild 1 tensor(s) are not bit-identical"},
    ])
    engine = start(server)
    try:
        applied = engine.apply_store_version(store, None, 1)
        assert (applied.how, applied.bytes_read, applied.detail) == ("full", 16, "no version of this store loaded")
        assert [p for p in server.paths() if p.split("?")[0] in ("/pause", "/collective_rpc", "/reset_prefix_cache",
                                                                 "/update_weight_version", "/resume")] == \
               ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
        (call,) = server.bodies("/collective_rpc")
        plan = json.loads(call["args"][0])
        assert call["method"] == "rollout_apply_store" and plan["deltas"] is None
        assert [step["dir"] for step in plan["chain"]] == [f"{store.url}/v00000001"]
        assert plan["final"] == [{"name": "w", "dtype": "F32", "shape": [4],
                                  "xxh3": store.manifest(1).tensors[0].xxh3}]
        assert engine.weight_version == 1 and server.weight_version == "1"
        with pytest.raises(EngineUnavailableError, match=r"could not load v1 of .*not bit-identical"):
            engine.apply_store_version(store, None, 1)
        assert not server.paused and engine.weight_version == 1
    finally:
        engine.close()
