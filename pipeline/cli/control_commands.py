"""A pool's desired state: `pipeline pause`, `pipeline resume`, `pipeline weights push | status`."""

from __future__ import annotations

import argparse
import json

from pipeline import settings
from pipeline.cli.command import EXIT_FAILED, Command, CommandGroup
from schemas.control import SWAP_MODES


class _DesiredStateCommand(Command):
    """`pause` and `resume`: the `Client` method of the command's name; prints the new generation."""

    connects = True

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.client import connect

        client = connect(args.redis, pool=args.pool)
        state = getattr(client, self.name)()
        print(f"pool {client.pool}: {self.name}d (generation {state.generation})")
        return 0


class PauseCommand(_DesiredStateCommand):
    name = "pause"
    help = "workers finish the batch in hand and take no new job"


class ResumeCommand(_DesiredStateCommand):
    name = "resume"
    help = "workers take jobs again"


class WeightsPushCommand(Command):
    name = "push"
    help = "make every worker load new weights; wait for all acknowledgements"
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("path", help="checkpoint directory, as the workers see it")
        parser.add_argument("--version", type=int, required=True,
                            help="the new weight version (newer than the current)")
        parser.add_argument("--timeout", type=float, default=600.0,
                            help="seconds to wait for acknowledgements (default 600)")
        parser.add_argument("--force", action="store_true",
                            help="allow a version not newer than the current one; also makes workers that failed "
                                 "to load the current weights try again (recovery: re-push the same path and "
                                 "version)")
        parser.add_argument("--mode", choices=SWAP_MODES, default="drain",
                            help="drain (default): samples in flight finish on the old weights first; partial: "
                                 "they stop at the next step and continue on the new weights, each token keeping "
                                 "its version")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.client import connect

        client = connect(args.redis, pool=args.pool)
        result = client.push_weights(args.path, version=args.version, timeout=args.timeout, force=args.force,
                                     mode=args.mode)
        print(f"pool {client.pool}: weights v{result.version} from {result.path} ({args.mode}): "
              f"{len(result.acks)} worker(s) acknowledged in {result.seconds:.2f} s")
        for ack in result.acks:
            # A worker whose engine cannot stop samples drains instead of a partial swap, and says so.
            print(f"  {ack.worker}: ok ({ack.seconds:.2f} s, {ack.mode})")
        return 0


class WeightsStatusCommand(Command):
    name = "status"
    help = "the pool's desired weights and each live worker's; exit 1 if any worker does not serve them"
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.audit.status import format_weights, weights
        from pipeline.broker.connection import connect_redis

        status = weights(connect_redis(args.redis), pool=args.pool or settings.pool())
        print(json.dumps(status, indent=2) if args.json else format_weights(status))
        return 0 if all(w["converged"] for w in status["workers"]) else EXIT_FAILED


class WeightsCommand(CommandGroup):
    name = "weights"
    help = "weight versions served by the workers"
    commands = (WeightsPushCommand, WeightsStatusCommand)
