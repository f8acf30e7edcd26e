"""The in-process sglang adapter, driven against a fake `sglang` module that records calls."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from schemas.request import RolloutRequest
from tests.helpers.sglang_wheel import engine_method_parameters, judge_generate
from workers.engines.factory import EngineOptions, build_engine
from workers.engines.seeds import sample_seed
from workers.engines.sglang.engine import SGLangEngine
from workers.errors import ContractViolation, EngineUnavailableError, UnsupportedRequestError


def real_signature(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Fails like Python would if `sglang.Engine.<method>` (SGLang's own source) could not take
    these arguments."""
    names = engine_method_parameters(method)
    if len(args) > len(names):
        raise TypeError(f"Engine.{method} takes {len(names)} arguments, got {len(args)}")
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"Engine.{method}() got unexpected keyword arguments {sorted(unknown)}")


class FakeEngine:
    """Records what the adapter asks; takes only what the real `sglang.Engine` takes (its method
    signatures, and SGLang's own request classes judge every generate call); answers like
    `sglang.Engine.async_generate` does."""

    instances: ClassVar[list[FakeEngine]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.calls: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []
        self.flushed = 0
        self.shut_down = False
        self.answer: Any = None  # override the canned answer
        self.block = False
        FakeEngine.instances.append(self)

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any:
        real_signature("async_generate", args, kwargs)
        verdict = judge_generate(kwargs, vocab_size=1000)
        if verdict.status != 200:
            raise ValueError(f"SGLang refuses this call: {verdict.error}")
        self.calls.append(kwargs)
        if self.block:
            await asyncio.sleep(3600)
        if kwargs["input_ids"] == [999]:
            raise ValueError("The input (1 tokens) is longer than the model's context length")
        if self.answer is not None:
            return self.answer
        n = kwargs["sampling_params"].get("n", 1)
        results = [self._result(kwargs, i) for i in range(n)]
        return results[0] if n == 1 else results

    def _result(self, kwargs: dict[str, Any], i: int) -> dict[str, Any]:
        out = [10 + i, 0]
        meta: dict[str, Any] = {"id": kwargs.get("rid"), "finish_reason": {"type": "stop", "matched": 0},
                                "prompt_tokens": len(kwargs["input_ids"]), "completion_tokens": 2,
                                "cached_tokens": 1, "weight_version": "default"}
        if kwargs.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.1, t, None] for t in out]
            meta["input_token_logprobs"] = [[None if j == 0 else -1.0, t, None]
                                            for j, t in enumerate(kwargs["input_ids"])] \
                if kwargs.get("logprob_start_len") == 0 else []
        return {"text": "x", "output_ids": out, "meta_info": meta}

    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> tuple[bool, str, int]:
        real_signature("update_weights_from_disk", args, kwargs)
        return self._update(*args, **kwargs)

    def _update(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        self.updates.append({"model_path": model_path, "load_format": load_format})
        ok = "missing" not in model_path
        return ok, "Succeeded to update model weights." if ok else "no such file", 0

    def flush_cache(self, *args: Any, **kwargs: Any) -> None:
        real_signature("flush_cache", args, kwargs)
        self.flushed += 1

    def get_model_info(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        real_signature("get_model_info", args, kwargs)
        return {"model_path": self.kwargs["model_path"], "weight_version": "default"}

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        real_signature("shutdown", args, kwargs)
        self.shut_down = True


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeEngine]]:
    module = types.ModuleType("sglang")
    module.Engine = FakeEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", module)
    FakeEngine.instances.clear()
    yield FakeEngine


def make(**kwargs: Any) -> tuple[SGLangEngine, FakeEngine]:
    engine = SGLangEngine("/models/m", **kwargs)
    return engine, FakeEngine.instances[-1]


def test_the_fake_takes_only_what_sglang_takes() -> None:
    """The checks above are SGLang's: a misspelt keyword or a sampling field SGLang refuses fails."""
    fake = FakeEngine(model_path="/models/m")
    with pytest.raises(TypeError, match="return_logprobs"):
        fake.loop.run_until_complete(fake.async_generate(input_ids=[1], return_logprobs=True))
    with pytest.raises(ValueError, match="unknown field `max_tokens`"):
        fake.loop.run_until_complete(fake.async_generate(input_ids=[1], sampling_params={"max_tokens": 3}))
    with pytest.raises(ValueError, match="top_p must be in"):
        fake.loop.run_until_complete(fake.async_generate(input_ids=[1], sampling_params={"top_p": 0}))
    with pytest.raises(TypeError, match="load_formats"):
        fake.update_weights_from_disk("/ckpt", load_formats="auto")
    assert fake.calls == []


def test_without_sglang_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail
    with pytest.raises(EngineUnavailableError, match=r"pip install 'rollout-pipeline\[sglang\]'"):
        SGLangEngine("/models/m")
    with pytest.raises(EngineUnavailableError, match=r"rollout-pipeline\[sglang\]"):
        build_engine(EngineOptions(engine="sglang", model="/models/m"))


def test_engine_args_reach_sglang(fake_sglang: type[FakeEngine]) -> None:
    engine, fake = make(engine_args={"tp_size": 2, "mem_fraction_static": 0.7}, max_top_logprobs=5)
    assert fake.kwargs == {"model_path": "/models/m", "tp_size": 2, "mem_fraction_static": 0.7}
    d = engine.description
    assert (d.name, d.model, d.capabilities.max_top_logprobs) == ("sglang", "/models/m", 5)


def test_generate_drives_async_generate_with_the_shared_mapping(fake_sglang: type[FakeEngine]) -> None:
    engine, fake = make()
    requests = [
        RolloutRequest.model_validate({"id": "a", "input_ids": [1, 2, 3], "prompt_logprobs": 0,
                                       "sampling_params": {"stop": [7], "seed": 4, "max_new_tokens": 5}}),
        RolloutRequest.model_validate({"id": "b", "input_ids": [4], "logprobs": None,
                                       "sampling_params": {"n": 2}}),
        RolloutRequest.model_validate({"id": "c", "input_ids": [5], "sampling_params": {"n": 2, "seed": 9}}),
    ]
    outputs = engine.generate(requests)
    assert [len(o) for o in outputs] == [1, 2, 2]
    first = fake.calls[0]
    assert first["input_ids"] == [1, 2, 3] and first["rid"].startswith("a-")
    assert (first["return_logprob"], first["logprob_start_len"], first["top_logprobs_num"]) == (True, 0, 0)
    assert first["sampling_params"]["stop_token_ids"] == [7]
    assert first["sampling_params"]["sampling_seed"] == 4
    assert "return_logprob" not in fake.calls[1] and fake.calls[1]["sampling_params"]["n"] == 2
    assert [c["sampling_params"]["sampling_seed"] for c in fake.calls[2:]] == [sample_seed(9, 0), sample_seed(9, 1)]
    [a] = outputs[0]
    assert a.token_ids.tolist() == [10, 0] and a.prompt_logprobs == [None, -1.0, -1.0]
    assert a.logprobs is not None and a.logprobs.tolist() == pytest.approx([-0.1, -0.1])
    assert [s.token_ids.tolist() for s in outputs[1]] == [[10, 0], [11, 0]]
    assert {s.weight_version for o in outputs for s in o} == {0}


def test_a_rejected_request_is_unsupported(fake_sglang: type[FakeEngine]) -> None:
    engine, _ = make()
    with pytest.raises(UnsupportedRequestError, match="context length"):
        engine.generate([RolloutRequest(id="long", input_ids=[999])])


def test_a_malformed_answer_is_a_contract_violation(fake_sglang: type[FakeEngine]) -> None:
    engine, fake = make()
    fake.answer = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "exploded"}}}
    with pytest.raises(ContractViolation, match="unknown finish_reason type"):
        engine.generate([RolloutRequest(id="x", input_ids=[1])])


def test_interrupted_batch_aborts_its_requests(fake_sglang: type[FakeEngine]) -> None:
    engine, fake = make()
    aborted: list[str] = []
    fake.tokenizer_manager = types.SimpleNamespace(abort_request=lambda rid: aborted.append(rid))  # type: ignore[attr-defined]
    fake.block = True

    def interrupt() -> None:
        raise KeyboardInterrupt  # what Ctrl-C (or RQ's timeout signal) does mid-batch

    fake.loop.call_later(0.2, interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([RolloutRequest(id="a", input_ids=[1]),
                         RolloutRequest(id="b", input_ids=[2], sampling_params={"n": 2})])
    assert len(aborted) == 3
    assert aborted[0].startswith("a-") and aborted[1].endswith("_0") and aborted[2].endswith("_1")


def test_lifecycle(fake_sglang: type[FakeEngine]) -> None:
    engine, fake = make(weight_version=3)
    engine.update_weights("/ckpt/step-4", 4)
    assert fake.updates == [{"model_path": "/ckpt/step-4", "load_format": None}]
    assert engine.weight_version == 4
    [[sample]] = engine.generate([RolloutRequest(id="a", input_ids=[1])])
    assert sample.weight_version == 4
    with pytest.raises(EngineUnavailableError, match="no such file"):
        engine.update_weights("/ckpt/missing", 5)
    assert engine.weight_version == 4
    engine.flush_cache()
    assert fake.flushed == 1
    assert engine.model_info()["model_path"] == "/models/m"
    engine.health()
    assert fake.calls[-1]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    engine.close()
    assert fake.shut_down


def test_factory_builds_both_sglang_engines(fake_sglang: type[FakeEngine]) -> None:
    engine = build_engine(EngineOptions(engine="sglang", model="/models/m", max_top_logprobs=2))
    assert isinstance(engine, SGLangEngine) and engine.description.capabilities.max_top_logprobs == 2
    with pytest.raises(EngineUnavailableError, match="needs --model"):
        build_engine(EngineOptions(engine="sglang"))
    with pytest.raises(EngineUnavailableError, match="needs at least one --url"):
        build_engine(EngineOptions(engine="sglang-http"))
