"""`pipeline worker`: start one worker process around one engine."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

import redis

from pipeline.core.broker.connection import is_unavailable
from pipeline.core.command import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, Command

log = logging.getLogger(__name__)


class WorkerCommand(Command):
    name = "worker"
    help = "run a worker process around one engine"
    connects = True
    pool_use = "names"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from workers.commands.worker_options import (
            add_engine_arguments,
            add_fault_arguments,
            add_observability_arguments,
        )
        from workers.jobs.checkpoint import DEFAULT_CHECKPOINT_EVERY_S

        add_engine_arguments(parser)
        add_fault_arguments(parser)
        parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
        parser.add_argument("--worker-id", default=None)
        parser.add_argument("--max-jobs-in-flight", type=int, default=64,
                            help="jobs fed to a concurrent engine (sim, sglang-http, vllm-http) at once")
        parser.add_argument("--no-feed", action="store_true",
                            help="one job at a time even on a concurrent engine (a barrier at each job's end)")
        parser.add_argument(
            "--checkpoint-every", type=float, default=DEFAULT_CHECKPOINT_EVERY_S, metavar="SECONDS",
            help="save the progress of samples in flight to Redis this often (and at every partial swap), so "
                 "a job whose worker dies resumes them on another worker; 0: off "
                 f"(default {DEFAULT_CHECKPOINT_EVERY_S:g}; see docs/checkpoints.md)")
        parser.add_argument("--log-level", default="INFO")
        add_observability_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.broker.connection import connect_redis
        from pipeline.core.warm_up import warm_up
        from workers.commands.worker_options import engine_options
        from workers.engines.factory import build_engine
        from workers.errors import WorkerError
        from workers.process.engine_worker import new_worker_id
        from workers.process.worker import RolloutWorker
        from workers.runtime import logs

        if args.checkpoint_every < 0:
            print(f"error: --checkpoint-every must be >= 0 seconds (0: off), got {args.checkpoint_every:g}",
                  file=sys.stderr)
            return EXIT_USAGE
        logs.configure(args.log_level, args.log_format)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack
        worker_id = args.worker_id or new_worker_id()
        logs.set_worker_id(worker_id)
        warm_up()
        try:
            engine = build_engine(engine_options(args))
        except WorkerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        worker = RolloutWorker(
            connect_redis(args.redis), engine, worker_id=worker_id,
            heartbeat_interval_s=args.heartbeat_interval, maintenance_interval_s=args.maintenance_interval,
            stuck_after_s=args.stuck_after, probe_max_s=args.health_probe_max,
            max_jobs_in_flight=args.max_jobs_in_flight, feed=not args.no_feed,
            checkpoint_every_s=args.checkpoint_every,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, pool=args.pool,
        )
        started = (f"worker {worker.worker_id}: pool={worker.pool.name} engine={engine.description.name} "
                   f"model={engine.description.model}")
        if worker.metrics.url:
            started += f" metrics={worker.metrics.url}"
        if args.log_format == "json":  # every line a JSON object: the start line is a log record too
            log.info("%s", started)
        else:
            print(started, flush=True)
        try:
            worker.work(burst=args.burst, logging_level=args.log_level, with_scheduler=False)
        except WorkerError as exc:  # e.g. the pool's weights do not load here: the worker does not join
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except redis.RedisError as exc:  # gone (or refusing) for good, or while stopping
            if not is_unavailable(exc):
                raise
            lost = isinstance(exc, redis.ConnectionError | redis.TimeoutError)
            state = "unreachable" if lost else "refusing commands"
            print(f"error: Redis {state} ({exc}); worker {worker.worker_id} stopped. A job it held runs again "
                  "on another worker once its lease expires.", file=sys.stderr)
            # Told twice to stop: it exits as it would with Redis up, though a Redis write of RQ's
            # teardown failed after the second signal (and took the place of its exit).
            return EXIT_FAILED if worker.shutdown.exiting else EXIT_UNREACHABLE
        return 0
