"""`pipeline worker`: start one worker process around one engine."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from workers.engines.factory import ENGINES, EngineOptions


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="hf")
    parser.add_argument("--model", default=None, help="model directory (default: the demo model)")
    parser.add_argument("--device", default="cpu", help="torch device for the hf engine")
    parser.add_argument(
        "--max-top-logprobs", type=int,
        default=int(os.environ.get("PIPELINE_MAX_TOP_LOGPROBS", "0")),
        help="serve top-k logprobs up to this k (default $PIPELINE_MAX_TOP_LOGPROBS or 0: off)",
    )
    parser.add_argument(
        "--url", action="append", default=[], dest="urls",
        help="SGLang server or router URL for --engine sglang-http (repeat for several)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        engine=args.engine, model=args.model, device=args.device, max_top_logprobs=args.max_top_logprobs,
        urls=tuple(args.urls),
    )


def _run_worker(args: argparse.Namespace) -> int:
    from pipeline.connection import connect_redis
    from workers.engines.factory import build_engine
    from workers.errors import WorkerError
    from workers.worker import RolloutWorker

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build_engine(engine_options(args))
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker = RolloutWorker(connect_redis(args.redis), engine, worker_id=args.worker_id)
    print(f"worker {worker.worker_id}: engine={engine.description.name} model={engine.description.model}",
          flush=True)
    worker.work(burst=args.burst, logging_level=args.log_level, with_scheduler=False)
    return 0


def register_worker(sub: argparse._SubParsersAction, add_redis: Callable[[argparse.ArgumentParser], None]) -> None:
    parser = sub.add_parser("worker", help="run a worker process around one engine")
    add_redis(parser)
    add_engine_arguments(parser)
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=_run_worker)
