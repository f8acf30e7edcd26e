"""Look at what there is: `pipeline status` (pools), `pipeline show` (rows), `pipeline report` (a run as HTML)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.core import settings
from pipeline.core.command import EXIT_FAILED, Command


class StatusCommand(Command):
    name = "status"
    help = "per pool: queue and agent turns, open agent sessions, workers, weight versions, runs, failures"
    connects = True
    pool_use = "reads"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run", default=None)
        parser.add_argument("--json", action="store_true")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.audit.status import collect, format_status
        from pipeline.core.broker.connection import connect_redis

        status = collect(connect_redis(args.redis), run=args.run, pool=self.pool(args))
        print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
        return 0


def _file_name(source: str) -> str:
    """A report's default file name: the run's name, or the last part of a shard URL, made file-safe."""
    import re

    name = source.rstrip("/").rsplit("/", 1)[-1] or "report"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


class ShowCommand(Command):
    name = "show"
    help = "print the rows of a run (by name), a run directory or a shard"
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("source", metavar="RUN_OR_URL",
                            help="a run name (its commit log) or a URL/directory of shards, or one shard")
        parser.add_argument("--limit", type=int, default=None)
        parser.add_argument("--token-ids", action="store_true", help="render tokens as token_id:<id> (display only)")
        parser.add_argument("--json", action="store_true", help="one JSON object per row")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.audit.display import format_rows, rows_as_json
        from pipeline.core.broker.connection import connect_redis
        from pipeline.core.shards import is_location, read_rollouts

        if is_location(args.source):
            table = read_rollouts(args.source)
        else:  # a run name: its committed shards ("did you mean" when no run has that name)
            table = read_rollouts([], args.source, conn=connect_redis(args.redis))
        if args.limit is not None:
            table = table.slice(0, args.limit)
        if table.num_rows == 0:
            print(f"no rows under {args.source}", file=sys.stderr)
            return EXIT_FAILED
        print(rows_as_json(table, token_ids=args.token_ids) if args.json
              else format_rows(table, token_ids=args.token_ids))
        return 0


class ReportCommand(Command):
    name = "report"
    help = ("one self-contained HTML page of a run: rewards, lengths, finishes, logprobs, workers, throughput, "
            "staleness, agent turns, verify")
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("source", metavar="RUN_OR_URL",
                            help="a run name (its commit log) or a URL/directory of shards")
        parser.add_argument("--out", default=None,
                            help="the HTML file to write (default: reports/<run>.html in the state directory, "
                                 "PIPELINE_HOME)")
        parser.add_argument("--verify-model", action="append", default=None, metavar="PATH|V=PATH",
                            help="also run `pipeline verify` with this model (as verify's --model) and show its "
                                 "summary")
        parser.add_argument("--verify-rows", type=int, default=None, metavar="N",
                            help="verify a random sample of N rows")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.audit.report import report
        from pipeline.core.broker.connection import connect_redis
        from pipeline.core.demo_model import resolve_versioned
        from pipeline.core.shards import is_location

        models = [resolve_versioned(model) for model in args.verify_model] if args.verify_model else None
        page = report(args.source, conn=None if is_location(args.source) else connect_redis(args.redis),
                      verify_model=models, verify_options={"rows": args.verify_rows})
        path = Path(args.out) if args.out else settings.home() / "reports" / f"{_file_name(args.source)}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
        print(f"wrote {path} ({len(page) // 1024} KiB): open {path.resolve().as_uri()} in a browser")
        return 0
