"""Building an engine from command-line choices."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engines.base import Engine
from workers.errors import EngineUnavailableError

ENGINES = ("hf", "sglang", "sglang-http", "sim")


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None  # a path; None means the demo model
    device: str = "cpu"
    max_top_logprobs: int = 0
    weight_version: int = 0
    urls: tuple[str, ...] = ()  # sglang-http: SGLang servers or routers
    sim: dict[str, float] = field(default_factory=dict)  # sim: SimConfig fields


def build_engine(options: EngineOptions) -> Engine:
    if options.engine == "hf":
        from workers.demo_model import DEMO_MODEL_NAME, ensure_demo_model
        from workers.engines.hf import HFEngine

        path = options.model or ensure_demo_model()
        return HFEngine(
            path,
            device=options.device,
            max_top_logprobs=options.max_top_logprobs,
            weight_version=options.weight_version,
            model_name=None if options.model else DEMO_MODEL_NAME,
        )
    if options.engine == "sim":
        from workers.engines.sim import SimConfig, SimEngine

        return SimEngine(SimConfig(**{"max_top_logprobs": options.max_top_logprobs,
                                      "weight_version": options.weight_version, **options.sim}))
    if options.engine == "sglang-http":
        from workers.engines.sglang_http import SGLangHTTPEngine

        if not options.urls:
            raise EngineUnavailableError("--engine sglang-http needs at least one --url http://host:port")
        return SGLangHTTPEngine(
            options.urls, max_top_logprobs=options.max_top_logprobs, weight_version=options.weight_version
        )
    if options.engine == "sglang":
        from workers.engines.sglang_engine import SGLangEngine

        if not options.model:
            raise EngineUnavailableError("--engine sglang needs --model PATH (a model SGLang can load)")
        return SGLangEngine(
            options.model, max_top_logprobs=options.max_top_logprobs, weight_version=options.weight_version
        )
    raise EngineUnavailableError(f"unknown engine {options.engine!r}; choose one of {', '.join(ENGINES)}")
