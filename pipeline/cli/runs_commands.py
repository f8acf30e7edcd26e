"""`pipeline runs [delete NAME ...]` and `pipeline pools [delete NAME ...]`: what exists, and forgetting it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import ClassVar

import redis

from pipeline.core import settings
from pipeline.core.command import Command
from pipeline.core.errors import PipelineError


class _ListOrDelete(Command):
    """`pipeline NOUNs` lists them; `pipeline NOUNs delete NAME ...` deletes the named ones."""

    connects = True
    noun: ClassVar[str]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("action", nargs="?", choices=["list", "delete"], default="list",
                            help=f"list (default) or delete the {self.noun}s named after it")
        parser.add_argument("names", nargs="*", metavar="NAME", help=f"delete: the {self.noun}s to delete")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.broker.connection import connect_redis

        conn = connect_redis(args.redis)
        if args.action == "list":
            if args.names:
                raise PipelineError(f"`pipeline {self.name}` lists every {self.noun}; to delete one: "
                                    f"`pipeline {self.name} delete {args.names[0]}`")
            print(self.listing(conn, args))
            return 0
        if not args.names:
            raise PipelineError(f"`pipeline {self.name} delete NAME ...` needs the {self.noun}s to delete "
                                f"(`pipeline {self.name}` lists them)")
        for name in args.names:
            print(self.delete(conn, name, args))
        return 0

    def listing(self, conn: redis.Redis, args: argparse.Namespace) -> str:
        raise NotImplementedError

    def delete(self, conn: redis.Redis, name: str, args: argparse.Namespace) -> str:
        raise NotImplementedError


class RunsCommand(_ListOrDelete):
    name = "runs"
    help = "the runs that exist, newest first, with their jobs and rows; `runs delete NAME` forgets one"
    noun = "run"
    pool_use = "reads"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--shards", action="store_true",
                            help="delete: remove the runs' shard directories too (default: they stay)")
        parser.add_argument("--json", action="store_true", help="list: print JSON")

    def listing(self, conn: redis.Redis, args: argparse.Namespace) -> str:
        from pipeline.audit.runs import format_runs, list_runs

        runs = list_runs(conn, pool=args.pool or settings.pool())
        return json.dumps([dataclasses.asdict(r) for r in runs], indent=2) if args.json else format_runs(runs)

    def delete(self, conn: redis.Redis, name: str, args: argparse.Namespace) -> str:
        from pipeline.core.jobs.forget import delete_run

        deleted = delete_run(conn, name, shards=args.shards)
        where = ", ".join(deleted.outputs) or "no output recorded"
        return (f"deleted run {deleted.run}: {deleted.jobs} job(s), {deleted.rows} row(s) committed; shards "
                + (f"removed from {where}" if deleted.shards_removed else f"kept at {where}"))


class PoolsCommand(_ListOrDelete):
    name = "pools"
    help = "the pools that exist; `pools delete NAME` forgets one: its desired weights, queues and runs"
    noun = "pool"

    def listing(self, conn: redis.Redis, args: argparse.Namespace) -> str:
        from pipeline.core.broker import registry
        from pipeline.core.broker.control_channel import read_state

        lines = []
        for name in registry.pools(conn):
            state = read_state(conn, name)
            lines.append(f"{name}: {len(registry.live_workers(conn, name))} live worker(s), weights "
                         f"v{state.weight_version}" + (f" from {state.weight_path}" if state.weight_path else "")
                         + (", paused" if state.paused else ""))
        return "\n".join(lines)

    def delete(self, conn: redis.Redis, name: str, args: argparse.Namespace) -> str:
        from pipeline.core.jobs.forget import delete_pool

        deleted = delete_pool(conn, name)
        return (f"deleted pool {deleted.pool}: desired weights v{deleted.weight_version}"
                + (f" from {deleted.weight_path}" if deleted.weight_path else "")
                + f", {len(deleted.runs)} run(s) (shards kept)")
