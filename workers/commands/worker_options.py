"""The options of `pipeline worker` (engine, fault handling, observability) and the engine they choose."""

from __future__ import annotations

import argparse

from pipeline.core import settings
from workers.engines.adapters.cache import DEFAULT_MAX_ADAPTERS
from workers.engines.factory import ENGINES, EngineOptions


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="hf")
    parser.add_argument("--model", default=None,
                        help="model directory (default: the demo model; `demo`, `demo-perturbed`: the demo model's); "
                             "for the HTTP engines, the directory "
                             "the servers load (read for its vocabulary size)")
    parser.add_argument("--device", default="cpu", help="torch device for the hf engine")
    parser.add_argument("--max-batch-sequences", type=int, default=64, metavar="N",
                        help="hf engine: samples of a job's requests decoded together in one batch (default 64)")
    parser.add_argument("--max-adapters", type=int, default=DEFAULT_MAX_ADAPTERS, metavar="N",
                        help="hf, sim, sglang-http and vllm-http engines: LoRA adapters kept resident; past N "
                             "the least recently used is evicted, and loaded again from its store when a job names it "
                             f"(default {DEFAULT_MAX_ADAPTERS}; docs/adapters.md)")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help="sglang-http and vllm-http engines: where LoRA adapter versions are written (PEFT format) "
                             "for the servers to load; a path the servers can read (default: rollout-adapters "
                             "under the system's temporary directory)")
    parser.add_argument(
        "--max-top-logprobs", type=int,
        default=settings.max_top_logprobs(),
        help="serve top-k logprobs up to this k (default $PIPELINE_MAX_TOP_LOGPROBS or 0: off)",
    )
    parser.add_argument(
        "--url", action="append", default=[], dest="urls",
        help="SGLang server or gateway (smg) URL for --engine sglang-http, vLLM server URL for --engine vllm-http "
             "(repeat for several)",
    )
    parser.add_argument(
        "--routed-experts", action="store_true",
        help="sglang engines: serve return_routed_experts (the servers need --enable-return-routed-experts); "
             "sim: simulate a mixture-of-experts model of --experts-layout; "
             "the layout comes from --model's config.json (for sglang-http, --model is then the model directory "
             "the servers load) or --experts-layout",
    )
    parser.add_argument("--experts-layout", default=None, metavar="LAYERS,TOP_K,EXPERTS",
                        help="routed-experts layout when no config.json is at hand, e.g. 48,8,128")
    sim = parser.add_argument_group("--engine sim (a simulated continuous-batching engine)")
    sim.add_argument("--sim-capacity", type=int, default=256, help="sequences decoded at once")
    sim.add_argument("--sim-step-ms", type=float, default=20.0, help="latency of one decode step")
    sim.add_argument("--sim-step-per-seq-us", type=float, default=0.0, help="added per running sequence")
    sim.add_argument("--sim-median-tokens", type=float, default=300.0, help="median output length")
    sim.add_argument("--sim-p99-tokens", type=float, default=4000.0, help="p99 output length (lognormal)")
    sim.add_argument("--sim-seed", type=int, default=0, help="seed of the tokens and logprobs")
    sim.add_argument("--sim-prefill-tokens-per-s", type=float, default=50_000.0,
                     help="uncached context tokens prefilled per second; the engine decodes nothing meanwhile "
                          "(0: prefill is free)")
    sim.add_argument("--sim-prefix-cache-tokens", type=int, default=1 << 20,
                     help="the prefix cache's size in tokens (LRU, emptied at a weight swap; 0: no cache)")
    sim.add_argument("--allow-sim-in-real-pool", action="store_true",
                     help="join (and load pushes of) a pool whose weights are a real model checkpoint; by default "
                          "the sim refuses them, so its made-up tokens are never labelled as a real model's")


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """How fast dead workers' jobs are found again and a failed engine is re-probed."""
    from workers.jobs.maintenance import DEFAULT_MAINTENANCE_INTERVAL_S, DEFAULT_STUCK_AFTER_S
    from workers.process.engine_worker import HEARTBEAT_INTERVAL_S
    from workers.process.health import PROBE_MAX_S

    parser.add_argument(
        "--heartbeat-interval", type=float, default=HEARTBEAT_INTERVAL_S, metavar="S",
        help="seconds between heartbeats; a job is abandoned 3 heartbeats + 1 s after its worker's last "
             f"(default {HEARTBEAT_INTERVAL_S})",
    )
    parser.add_argument(
        "--maintenance-interval", type=float, default=DEFAULT_MAINTENANCE_INTERVAL_S, metavar="S",
        help="seconds between scans for abandoned jobs, which are retried or failed "
             f"(default {DEFAULT_MAINTENANCE_INTERVAL_S})",
    )
    parser.add_argument(
        "--stuck-after", type=float, default=DEFAULT_STUCK_AFTER_S, metavar="S",
        help="a job dequeued but not started for this long (its worker died) is recovered "
             f"(default {DEFAULT_STUCK_AFTER_S:g})",
    )
    parser.add_argument(
        "--health-probe-max", type=float, default=PROBE_MAX_S, metavar="S",
        help=f"longest wait between engine health probes while unhealthy (default {PROBE_MAX_S:g})",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    from pipeline.core.demo_model import resolve

    return EngineOptions(
        engine=args.engine, model=args.model and resolve(args.model), device=args.device,
        max_top_logprobs=args.max_top_logprobs, max_batch_sequences=args.max_batch_sequences,
        max_adapters=args.max_adapters, adapter_dir=args.adapter_dir, urls=tuple(args.urls),
        routed_experts=args.routed_experts,
        experts_layout=args.experts_layout,
        sim={
            "capacity": args.sim_capacity, "step_s": args.sim_step_ms / 1000,
            "step_per_seq_s": args.sim_step_per_seq_us / 1e6, "median_tokens": args.sim_median_tokens,
            "p99_tokens": args.sim_p99_tokens, "seed": args.sim_seed, "real_weights": args.allow_sim_in_real_pool,
            "prefill_tokens_per_s": args.sim_prefill_tokens_per_s, "prefix_cache_tokens": args.sim_prefix_cache_tokens,
        } if args.engine == "sim" else {},
    )


def _metrics_port() -> int | None:
    try:
        return settings.metrics_port()
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    """Prometheus metrics endpoint and log format."""
    from workers.process.metrics import DEFAULT_METRICS_HOST, ENV_METRICS_PORT
    from workers.runtime.logs import ENV_LOG_FORMAT, FORMATS, default_format

    parser.add_argument(
        "--metrics-port", type=int, default=_metrics_port(), metavar="PORT",
        help=f"serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port, logged); "
             f"default ${ENV_METRICS_PORT}, else no endpoint",
    )
    parser.add_argument(
        "--metrics-host", default=DEFAULT_METRICS_HOST, metavar="HOST",
        help=f"address the metrics endpoint binds to (default {DEFAULT_METRICS_HOST}; 0.0.0.0 only on a "
             "private network, e.g. inside a container)",
    )
    parser.add_argument(
        "--log-format", choices=FORMATS, default=default_format(),
        help=f"text, or json: one JSON object per line with worker, job id and run (default ${ENV_LOG_FORMAT} "
             "or text)",
    )
