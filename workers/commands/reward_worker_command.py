"""`pipeline reward-worker`: score committed shards with their run's reward function (the CPU side of rewards)."""

from __future__ import annotations

import argparse

from pipeline.core.command import Command


class RewardWorkerCommand(Command):
    name = "reward-worker"
    help = "score committed shards with their run's reward function"
    connects = True
    pool_use = "names"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from workers.process.metrics import DEFAULT_METRICS_HOST
        from workers.rewards.reward_worker import DEFAULT_BATCH_ROWS, DEFAULT_CLAIM_AFTER_S

        parser.add_argument("--burst", action="store_true", help="exit when nothing is left to score")
        parser.add_argument("--worker-id", default=None)
        parser.add_argument("--batch-rows", type=int, default=DEFAULT_BATCH_ROWS,
                            help=f"rows per call of the reward function (default {DEFAULT_BATCH_ROWS})")
        parser.add_argument("--claim-after", type=float, default=DEFAULT_CLAIM_AFTER_S, metavar="S",
                            help="take over a shard another worker took and did not finish after S seconds "
                                 f"(default {DEFAULT_CLAIM_AFTER_S:g}; longer than scoring one shard)")
        parser.add_argument("--log-level", default="INFO")
        parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                            help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port)")
        parser.add_argument("--metrics-host", default=DEFAULT_METRICS_HOST, metavar="HOST",
                            help=f"address the metrics endpoint binds to (default {DEFAULT_METRICS_HOST})")

    def run(self, args: argparse.Namespace) -> int:
        import logging
        import signal

        from pipeline.core.broker.connection import connect_redis
        from workers.rewards.reward_worker import RewardWorker

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        worker = RewardWorker(connect_redis(args.redis), worker_id=args.worker_id, batch_rows=args.batch_rows,
                              claim_after_s=args.claim_after)
        for signum in (signal.SIGTERM, signal.SIGINT):  # finish the shard in hand, then exit
            signal.signal(signum, lambda *_: worker.stop.set())
        if args.metrics_port is not None:
            worker.metrics.serve(args.metrics_port, args.metrics_host)
        try:
            worker.work(burst=args.burst)
        finally:
            worker.metrics.close()
        return 0
