"""A pool's desired state: `pipeline pause`, `pipeline resume`, `pipeline weights push | status`."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import TYPE_CHECKING

import redis

from pipeline.core import settings
from pipeline.core.adapters import DEFAULT_KEEP_VERSIONS
from pipeline.core.command import EXIT_FAILED, Command, CommandGroup
from pipeline.core.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.client import Client
from schemas.control import SWAP_MODES


class _DesiredStateCommand(Command):
    """`pause` and `resume`: the `Client` method of the command's name; prints the new generation."""

    connects = True
    pool_use = "names"

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
    pool_use = "names"

    def new_pool(self, pool: str) -> None:
        print(f"warning: no worker has ever served pool {pool!r} and nothing was submitted to it; the push is "
              "recorded for workers that join it", file=sys.stderr)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("path", help="checkpoint directory, as the workers see it (`demo`, `demo-perturbed`: "
                                         "the demo model's); with --adapter, a PEFT adapter directory")
        parser.add_argument("--version", type=int,
                            help="the new weight version (newer than the current); required without --adapter")
        parser.add_argument("--adapter", metavar="NAME",
                            help="push a LoRA adapter (the directory peft's save_pretrained wrote) as the next "
                                 "version of NAME, acknowledged by every live worker serving adapters; jobs "
                                 "admitted after it run it, jobs in flight finish on theirs (docs/adapters.md)")
        parser.add_argument("--base", metavar="DIR",
                            help="with --adapter: the base model directory the adapter is checked against "
                                 "(default: the pool's weight store, else a live worker's model directory)")
        parser.add_argument("--keep-versions", type=int, default=None, metavar="N",
                            help=f"with --adapter: keep the adapter's last N versions in its store, pruning older ones "
                                 f"no live worker holds (default {DEFAULT_KEEP_VERSIONS}; 0 keeps every version)")
        parser.add_argument("--timeout", type=float, default=600.0,
                            help="seconds to wait for acknowledgements (default 600)")
        parser.add_argument("--force", action="store_true",
                            help="allow a version not newer than the current one; also makes workers that failed "
                                 "to load the current weights try again (recovery: re-push the same path and "
                                 "version)")
        parser.add_argument("--mode", choices=SWAP_MODES, default="drain",
                            help="drain (default): samples in flight finish on the old weights first (with "
                                 "--adapter: on the adapter version they pinned; nothing pauses); partial: they "
                                 "stop at the next step and continue on the new weights (adapter version), each "
                                 "token keeping its version")
        parser.add_argument("--delta", action="store_true",
                            help="write the checkpoint into a weight store as a delta against the version before "
                                 "(a full version first, and every --full-every); workers apply it in place and "
                                 "check every tensor bit for bit (docs/control.md \"Pushes from memory\")")
        parser.add_argument("--store", metavar="URL",
                            help="the weight store (fsspec URL) of a store push; default "
                                 "<PIPELINE_HOME>/weights/<pool>; without --delta the version is stored in full")
        parser.add_argument("--full-every", type=int, metavar="K",
                            help="with --delta/--store: a full version after K-1 deltas (default 10)")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.client import connect
        from pipeline.core.demo_model import resolve
        from pipeline.weights.push import StorePushResult, store_url

        client = connect(args.redis, pool=args.pool)
        if args.adapter is not None:
            return _push_adapter(client, args)
        if args.version is None:
            raise PipelineError("pipeline weights push PATH needs --version N (the new weight version), or "
                                "--adapter NAME for a LoRA adapter")
        if args.keep_versions is not None:
            raise PipelineError("--keep-versions is an option of --adapter pushes (a base weight store keeps what "
                                "its live workers serve); drop it")
        path = resolve(args.path)
        store = store_url(args.store, client.pool) if args.delta or args.store is not None else None
        _check_target(client.conn, client.pool, path, read_here=store is not None)
        result = client.push_weights(path, version=args.version, timeout=args.timeout, force=args.force,
                                     mode=args.mode, store=store, delta=args.delta, full_every=args.full_every)
        stored = isinstance(result, StorePushResult)
        where = (f"{path} via {store} ({result.kind}: {_size(result.stored_bytes)} stored for a "
                 f"{_size(result.model_bytes)} model)") if isinstance(result, StorePushResult) else result.path
        print(f"pool {client.pool}: weights v{result.version} from {where} ({args.mode}): "
              f"{len(result.acks)} worker(s) acknowledged in {result.seconds:.2f} s")
        for ack in result.acks:
            # A worker whose engine cannot stop samples drains instead of a partial swap, and says so.
            how = f", {ack.applied}, {_size(ack.bytes_read)} read" if stored else ""
            detail = f": {ack.detail}" if ack.detail else ""
            read = f"read in {ack.prepare_seconds:.2f} s while generating, then " if ack.prepare_seconds else ""
            print(f"  {ack.worker}: ok ({read}paused {ack.seconds:.2f} s, {ack.mode}{how}){detail}")
        return 0


def _push_adapter(client: Client, args: argparse.Namespace) -> int:
    """`pipeline weights push --adapter NAME DIR`: the adapter's next version, stored and current."""
    from pipeline.core.demo_model import resolve

    given = [flag for flag, value in (("--version", args.version), ("--delta", args.delta),
                                       ("--full-every", args.full_every), ("--force", args.force)) if value]
    if given:
        raise PipelineError(f"{', '.join(given)}: options of base weight pushes, not of --adapter (an adapter's "
                            "versions are numbered by the pool, each stored in full); drop them")
    base = None if args.base is None else resolve(args.base)
    keep = DEFAULT_KEEP_VERSIONS if args.keep_versions is None else args.keep_versions
    result = client.push_adapter(args.adapter, args.path, base=base, store=args.store, keep=keep,
                                 timeout=args.timeout, mode=args.mode)
    status = "current" if result.current else "stored, but a newer version pushed at the same time is current"
    pruned = f"; pruned v{', v'.join(map(str, result.pruned))}" if result.pruned else ""
    print(f"pool {client.pool}: adapter {result.name} v{result.version} from {args.path} "
          f"({_size(result.stored_bytes)} stored at {result.url}, {result.seconds:.2f} s): {status}{pruned}; "
          f"{len(result.acks)} worker(s) acknowledged")
    for ack in result.acks:
        # A partial push says how many samples its worker stopped and continued on the new version.
        how = f"{ack.mode}: {ack.detail}" if ack.detail else "no pause"
        print(f"  {ack.worker}: ok (v{ack.version}, {_size(ack.bytes_read)} read and checked in "
              f"{ack.prepare_seconds:.2f} s, {how})")
    return 0


def _size(count: int) -> str:
    return f"{count / 1e6:.2f} MB"


def _check_target(conn: redis.Redis, pool: str, path: str, *, read_here: bool) -> None:
    """Before a push: refuse a local path that does not exist when this command reads it (`read_here`:
    a store push writes the checkpoint into the store) or when every live worker of the pool runs
    here and loads weights from this disk (the hf engine; HTTP engines' servers and the sim read paths
    of their own); warn when it is missing here only."""
    from pipeline.core.broker import registry

    if "://" in path or os.path.exists(path):
        return
    from pipeline.core.demo_model import NAMES
    from pipeline.core.suggest import did_you_mean

    hint = did_you_mean(path, NAMES)  # a mistyped `demo-perturbed`
    if hint:
        raise PipelineError(f"weight path {path} does not exist{hint} (the demo model's names); nothing was pushed")
    if read_here:
        raise PipelineError(f"weight path {path} does not exist: a store push (--delta/--store) reads the checkpoint "
                            "here to write it into the weight store; give the directory save_pretrained wrote. "
                            "Nothing was pushed")
    live = registry.live_workers(conn, pool)
    if live and all(w.host == socket.gethostname() and w.engine == "hf" for w in live):
        raise PipelineError(f"weight path {path} does not exist (every live worker of pool {pool!r} loads from "
                            "this machine's disk); nothing was pushed")
    print(f"warning: weight path {path} does not exist on this machine; the workers must see it where they run",
          file=sys.stderr)


class WeightsStatusCommand(Command):
    name = "status"
    help = "the pool's desired weights and each live worker's; exit 1 if any worker does not serve them"
    connects = True
    pool_use = "reads"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.audit.status import format_weights, weights
        from pipeline.core.broker.connection import connect_redis

        status = weights(connect_redis(args.redis), pool=args.pool or settings.pool())
        print(json.dumps(status, indent=2) if args.json else format_weights(status))
        return 0 if all(w["converged"] for w in status["workers"]) else EXIT_FAILED


class WeightsCommand(CommandGroup):
    name = "weights"
    help = "weight versions served by the workers"
    commands = (WeightsPushCommand, WeightsStatusCommand)
