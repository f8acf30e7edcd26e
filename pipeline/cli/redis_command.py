"""`pipeline redis start | stop | url`: the embedded Redis server."""

from __future__ import annotations

import argparse

from pipeline.core.command import Command


class RedisCommand(Command):
    name = "redis"
    help = "the embedded Redis server"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", choices=["start", "stop", "url"])

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.broker.redis_server import embedded_server

        server = embedded_server()
        if args.action == "start":
            print(server.ensure_started())
        elif args.action == "url":
            print(server.url if server.is_running() else "not running")
        elif args.action == "stop":
            print("stopped" if server.stop() else "not running")
        return 0
