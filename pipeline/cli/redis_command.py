"""`pipeline redis start | stop | url`: the embedded Redis server. `start` prints its URL with the
password redacted (a terminal's scrollback, a CI log); `url` prints it whole, for a script."""

from __future__ import annotations

import argparse
import sys

import redis

from pipeline.core.command import Command
from pipeline.core.errors import PipelineError
from pipeline.core.suggest import listing


class RedisCommand(Command):
    name = "redis"
    help = "the embedded Redis server"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["start", "stop", "url"],
                            help="start (prints the URL, password redacted), stop, or url (the URL whole, "
                                 "password included: `export PIPELINE_REDIS_URL=$(pipeline redis url)`)")
        parser.add_argument("--force", action="store_true",
                            help="stop: even while workers are registered on it (they lose their Redis)")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.broker.redis_server import embedded_server

        server = embedded_server()
        if args.action == "start":
            from pipeline.core.broker.connection import redacted

            print(redacted(server.ensure_started()))
            print("the URL with its password: `pipeline redis url` (commands on this machine need none of it: "
                  "they find the embedded server themselves)", file=sys.stderr)
        elif args.action == "url":
            print(server.url if server.is_running() else "not running")
        elif args.action == "stop":
            if server.is_running() and not args.force:
                live = _live_workers(server.client())
                if live:
                    raise PipelineError(f"{len(live)} worker(s) use this Redis ({listing(live)}); stop them first "
                                        "(SIGTERM), or `pipeline redis stop --force`; nothing was stopped")
            print("stopped" if server.stop() else "not running")
        return 0


def _live_workers(conn: redis.Redis) -> list[str]:
    """The rollout and agent workers registered on `conn`, across pools."""
    from pipeline.core.broker import keys, registry

    names: list[str] = []
    for pool in registry.pools(conn):
        names += [w.worker_id for w in registry.live_workers(conn, pool)]
        where = keys.pool(pool)
        names += [m.decode() for m in conn.smembers(where.agent_workers) if conn.exists(where.agent_worker(m.decode()))]
    return names
