"""`pipeline agent-worker`: run agent episodes (`pipeline submit --agent`) against `pipeline serve`, on CPU."""

from __future__ import annotations

import argparse

from pipeline.core.command import Command


class AgentWorkerCommand(Command):
    name = "agent-worker"
    help = ("run agent episodes: up to --concurrency at once in all (across its agents), each in a fresh "
            "session of `pipeline serve`")
    connects = True
    pool_use = "names"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from pipeline.core import settings
        from workers.agents.worker import DEFAULT_CLAIM_AFTER_S, DEFAULT_CONCURRENCY, DEFAULT_GRACE_S

        parser.add_argument("--agent", action="append", required=True, metavar="MODULE:FUNCTION",
                            help="an agent this worker runs (the one `pipeline submit --agent` named); repeatable. "
                                 "A worker imports only these, never a name read from Redis")
        parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="C",
                            help="the most episodes this worker runs at once, all its --agent's together (two agents "
                                 f"and C 4: 4 in all, not 4 each; default {DEFAULT_CONCURRENCY})")
        parser.add_argument("--serve", default=None, metavar="URL",
                            help=f"the `pipeline serve` to open sessions on (default ${settings.SERVE_URL.name}, "
                                 f"else {settings.SERVE_URL.default})")
        parser.add_argument("--api-key", default=None, metavar="KEY",
                            help=f"the server's API key (default ${settings.SERVE_API_KEY.name})")
        parser.add_argument("--claim-after", type=float, default=DEFAULT_CLAIM_AFTER_S, metavar="S",
                            help="take over the episodes of an agent worker silent this long (it died; default "
                                 f"{DEFAULT_CLAIM_AFTER_S:g})")
        parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="S",
                            help="on SIGTERM, seconds the episodes in flight get to finish before they are "
                                 f"cancelled and left to another worker (default {DEFAULT_GRACE_S:g})")
        parser.add_argument("--burst", action="store_true", help="exit when no episode is left to run")
        parser.add_argument("--worker-id", default=None)
        parser.add_argument("--log-level", default="INFO")

    def run(self, args: argparse.Namespace) -> int:
        import logging

        from pipeline.core import agents, settings
        from pipeline.core.broker.connection import connect_redis
        from workers.agents.worker import AgentWorker

        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        settings.default_agents_sdk_tracing_off()
        loaded = {path: agents.load(path) for path in dict.fromkeys(args.agent)}
        worker = AgentWorker(connect_redis(args.redis), loaded, serve_url=args.serve or settings.serve_url(),
                             api_key=args.api_key or settings.serve_api_key(), pool=args.pool,
                             concurrency=args.concurrency, claim_after_s=args.claim_after, grace_s=args.grace,
                             worker_id=args.worker_id)
        worker.work(burst=args.burst)
        return 0
