"""Building an engine from command-line choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workers.engines.adapters.cache import DEFAULT_MAX_ADAPTERS
from workers.engines.base import Engine
from workers.errors import EngineUnavailableError

ENGINES = ("hf", "sglang", "sglang-http", "vllm-http", "sim")


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "hf"
    model: str | None = None  # a path; None means the demo model
    device: str = "cpu"
    max_top_logprobs: int = 0
    weight_version: int = 0
    max_batch_sequences: int = 64  # hf: samples decoded together
    max_adapters: int = DEFAULT_MAX_ADAPTERS  # hf, sim, sglang-http, vllm-http: LoRA adapters resident (LRU)
    adapter_dir: str | None = None  # sglang-http, vllm-http: where adapters are written for the servers to load
    urls: tuple[str, ...] = ()  # sglang-http: SGLang servers or gateways; vllm-http: vLLM servers
    sim: dict[str, float] = field(default_factory=dict)  # sim: SimConfig fields
    routed_experts: bool = False  # sglang and sim engines: serve return_routed_experts
    experts_layout: str | None = None  # "LAYERS,TOP_K,EXPERTS" when no model config is at hand


def _sglang_model_facts(options: EngineOptions) -> dict[str, object]:
    """Routed-experts layout and vocabulary size for the SGLang adapters, from flags or the model's config."""
    from workers.engines.sglang.expert_ids import ExpertsLayout

    facts: dict[str, object] = {"routed_experts": options.routed_experts}
    layout = None
    if options.experts_layout:
        try:
            layers, top_k, experts = (int(part) for part in options.experts_layout.split(","))
        except ValueError as exc:
            raise EngineUnavailableError(
                f"--experts-layout {options.experts_layout!r} must be LAYERS,TOP_K,EXPERTS, e.g. 48,8,128"
            ) from exc
        layout = ExpertsLayout(layers=layers, top_k=top_k, num_experts=experts)
    elif options.model:
        layout = ExpertsLayout.from_model_config(options.model)
    if options.routed_experts:
        if layout is None:
            raise EngineUnavailableError(
                "--routed-experts needs the layout: --model DIR with a MoE config.json, or --experts-layout"
            )
        facts["experts_layout"] = layout
    vocab = _vocab_size(options)
    if vocab is not None:
        facts["vocab_size"] = vocab
    return facts


def _vocab_size(options: EngineOptions) -> int | None:
    """The vocabulary size in `--model`'s config.json, when given and readable."""
    from workers.engines import model_config

    return model_config.vocab_size(options.model) if options.model else None


def build_engine(options: EngineOptions) -> Engine:
    if options.engine == "hf":
        from workers.engines.hf.demo_model import DEMO_MODEL_NAME, cache_dir, ensure_demo_model
        from workers.engines.hf.engine import HFEngine

        path = options.model or ensure_demo_model()
        return HFEngine(
            path,
            device=options.device,
            max_top_logprobs=options.max_top_logprobs,
            weight_version=options.weight_version,
            model_name=DEMO_MODEL_NAME if Path(path) == cache_dir() else None,  # `--model demo` too
            max_batch_sequences=options.max_batch_sequences,
            max_adapters=options.max_adapters,
        )
    if options.engine == "sim":
        from workers.engines.sim.engine import SimConfig, SimEngine

        experts = None
        if options.routed_experts:
            layout = _sglang_model_facts(options)["experts_layout"]
            experts = (layout.layers, layout.top_k, layout.num_experts or 2 * layout.top_k)  # type: ignore[attr-defined]
        return SimEngine(SimConfig(**{"max_top_logprobs": options.max_top_logprobs, "experts": experts,
                                      "weight_version": options.weight_version,
                                      "max_adapters": options.max_adapters, **options.sim}))
    if options.engine == "sglang-http":
        from workers.engines.sglang.http_engine import SGLangHTTPEngine

        if not options.urls:
            raise EngineUnavailableError("--engine sglang-http needs at least one --url http://host:port")
        return SGLangHTTPEngine(
            options.urls, max_top_logprobs=options.max_top_logprobs, weight_version=options.weight_version,
            max_adapters=options.max_adapters, adapter_dir=Path(options.adapter_dir) if options.adapter_dir else None,
            **_sglang_model_facts(options),  # type: ignore[arg-type]
        )
    if options.engine == "vllm-http":
        from workers.engines.vllm.http_engine import VLLMHTTPEngine

        if not options.urls:
            raise EngineUnavailableError("--engine vllm-http needs at least one --url http://host:port")
        if options.routed_experts:
            raise EngineUnavailableError("--engine vllm-http does not serve routed experts; drop --routed-experts")
        return VLLMHTTPEngine(options.urls, max_top_logprobs=options.max_top_logprobs,
                              weight_version=options.weight_version, vocab_size=_vocab_size(options),
                              max_adapters=options.max_adapters,
                              adapter_dir=Path(options.adapter_dir) if options.adapter_dir else None)
    if options.engine == "sglang":
        from workers.engines.sglang.engine import SGLangEngine

        if not options.model:
            raise EngineUnavailableError("--engine sglang needs --model PATH (a model SGLang can load)")
        return SGLangEngine(
            options.model, max_top_logprobs=options.max_top_logprobs, weight_version=options.weight_version,
            **_sglang_model_facts(options),  # type: ignore[arg-type]
        )
    raise EngineUnavailableError(f"unknown engine {options.engine!r}; choose one of {', '.join(ENGINES)}")
