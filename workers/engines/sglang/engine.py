"""The `sglang` engine: an in-process `sglang.Engine` (imported lazily; needs a GPU).

Each batch runs as concurrent `Engine.async_generate` calls on the engine's own event loop
(`entrypoints/engine.py`), with the same request and result mapping as the HTTP adapter
(`sglang_mapping`). The Engine has no pause: between batches the worker simply submits
nothing. Weight updates go through `Engine.update_weights_from_disk`; since this adapter is
the only one that changes the engine's weights, it stamps samples with its own version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.engines.async_bridge import run_batch
from workers.engines.base import EngineDescription, EngineIdentity, SampleOutput
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.engines.sglang.mapping import GenerateCall, generate_calls, parse_call_results
from workers.errors import EngineUnavailableError, UnsupportedRequestError

T = TypeVar("T")

INSTALL_HINT = "pip install 'rollout-pipeline[sglang]' (on a machine with a GPU and CUDA)"


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise EngineUnavailableError(f"the sglang engine needs SGLang, which is not installed: {INSTALL_HINT}") from exc
    return sglang


class SGLangEngine(EngineIdentity):
    """A `sglang.Engine` loaded once in this process."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_top_logprobs: int = 0,
        routed_experts: bool = False,
        experts_layout: ExpertsLayout | None = None,
        weight_version: int = 0,
        model_name: str | None = None,
        vocab_size: int | None = None,
        max_in_flight: int = 1024,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        sglang = _import_sglang()
        self._layout = None
        if routed_experts:
            self._layout = experts_layout or ExpertsLayout.from_model_config(model_path)
            if self._layout is None:
                raise EngineUnavailableError(
                    f"routed experts need a MoE model: {model_path}/config.json has no num_experts_per_tok"
                )
        kwargs: dict[str, Any] = {"model_path": str(model_path), **(engine_args or {})}
        if routed_experts:
            kwargs.setdefault("enable_return_routed_experts", True)
        try:
            self._engine = sglang.Engine(**kwargs)
        except Exception as exc:
            raise EngineUnavailableError(f"sglang.Engine could not load {model_path}: {exc}") from exc
        loop = getattr(self._engine, "loop", None)
        self._loop: asyncio.AbstractEventLoop = loop if loop is not None else asyncio.new_event_loop()
        self._weight_version = weight_version
        self.max_in_flight = max_in_flight
        self._description = EngineDescription(
            name="sglang",
            model=model_name or str(model_path),
            capabilities=Capabilities(
                max_top_logprobs=max_top_logprobs,
                prompt_logprobs=True,
                routed_experts=routed_experts,
                vocab_size=vocab_size,
            ),
            num_experts=self._layout.num_experts if self._layout else None,
        )

    @property
    def engine(self) -> Any:
        return self._engine

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run on the engine's loop; if interrupted, cancel the batch before re-raising."""
        task = self._loop.create_task(coro)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    self._loop.run_until_complete(task)
            raise

    async def _call(self, call: GenerateCall, slots: asyncio.Semaphore) -> list[SampleOutput]:
        async with slots:
            try:
                body = await self._engine.async_generate(**call.payload)
            except ValueError as exc:
                raise UnsupportedRequestError(f"request {call.request.id!r}: SGLang rejected it: {exc}") from exc
            except asyncio.CancelledError:
                self._abort(call)
                raise
        samples = parse_call_results(call, body, layout=self._layout)
        for sample in samples:
            sample.weight_version = self._weight_version
        return samples

    def _abort(self, call: GenerateCall) -> None:
        manager = getattr(self._engine, "tokenizer_manager", None)
        if manager is None:
            return
        for rid in call.sglang_rids:
            with contextlib.suppress(Exception):
                manager.abort_request(rid=rid)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        slots = asyncio.Semaphore(self.max_in_flight)
        return self._run(run_batch(requests, generate_calls, lambda call: self._call(call, slots)))

    # -- lifecycle ---------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return dict(self._engine.get_model_info())

    def health(self) -> None:
        """A one-token greedy generation, like SGLang's /health_generate."""
        try:
            self._run(self._engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1,
                                                                                  "temperature": 0.0}))
        except Exception as exc:
            raise EngineUnavailableError(f"sglang engine health check failed: {exc}") from exc

    def update_weights(self, path: str, version: int) -> None:
        """`Engine.update_weights_from_disk`; raises with SGLang's message on failure."""
        result = self._engine.update_weights_from_disk(model_path=str(path))
        success, message = (result[0], result[1]) if isinstance(result, tuple) else (bool(result), "")
        if not success:
            raise EngineUnavailableError(f"sglang update_weights_from_disk({path}) failed: {message}")
        self._weight_version = version

    def flush_cache(self) -> None:
        self._engine.flush_cache()

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
