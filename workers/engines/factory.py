"""Building an engine from command-line choices."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engines.base import Engine
from workers.errors import EngineUnavailableError

ENGINES = ("hf",)


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None  # a path; None means the demo model
    device: str = "cpu"
    max_top_logprobs: int = 0
    weight_version: int = 0


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
    raise EngineUnavailableError(f"unknown engine {options.engine!r}; choose one of {', '.join(ENGINES)}")
