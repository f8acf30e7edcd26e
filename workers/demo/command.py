"""`pipeline demo`: the whole loop on the embedded default with the demo model (`workers.demo.run`)."""

from __future__ import annotations

import argparse

from pipeline.core.command import Command


class DemoCommand(Command):
    name = "demo"
    help = ("run the whole loop on the embedded default with the demo model, in a pool of its own (`demo`, or "
            "--pool; not $PIPELINE_POOL) whose weights it resets first")
    connects = True
    pool_use = "names"

    def pool(self, args: argparse.Namespace) -> str | None:
        from workers.demo.run import DEMO_POOL

        return args.pool or DEMO_POOL

    def new_pool(self, pool: str) -> None:
        """Nothing to say: the demo makes its pool on purpose."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--requests", default="examples/rollouts.jsonl")
        parser.add_argument("--run", default=None)
        parser.add_argument("--max-new-tokens", type=int, default=32)
        parser.add_argument("--n", type=int, default=2)
        parser.add_argument("--batch-size", type=int, default=4)

    def run(self, args: argparse.Namespace) -> int:
        from workers.demo.run import run_demo

        return run_demo(args)
