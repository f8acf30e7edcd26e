"""The one protocol of a `pipeline` subcommand (after vLLM's `CLISubcommand`).

To add `pipeline NAME`:
1. write `class NameCommand(Command)` with `name`, `help`, `connects = True` if it talks to Redis,
   `add_arguments(parser)` and `run(args) -> int | None` (heavy imports inside `run()`);
2. list it in pyproject.toml under `[project.entry-points."pipeline.commands"]`:
   `NAME = "package.module:NameCommand"`;
3. reinstall (`pip install -e .`); `pipeline NAME --help` shows it.

`pipeline`'s own commands and those the `workers` package contributes are all found that way,
so `pipeline` never imports `workers`. A command made of subcommands (`pipeline weights push`)
is a `CommandGroup` listing their classes. `run()` returns the exit code (None is 0); a
`PipelineError` it raises becomes one `error: ...` line and its code (`pipeline.cli.main`).

Loading a command's module must stay cheap: every command's `name` and `help` are read for
`pipeline --help`. Heavy imports (torch, transformers, engines, the worker process) go inside
`run()`, or inside `add_arguments()` when a default or a choice needs them: only the command
being run gets its arguments added, so `pipeline submit` never loads the GPU side.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import ClassVar

# Exit codes (README "Exit codes"): scripts and orchestrators tell these apart. `run()` returns
# one of them; the errors that end a command are mapped by `pipeline.cli.main.exit_code`.
EXIT_FAILED = 1  # jobs failed, a worker failed to load pushed weights, nothing to show
EXIT_USAGE = 2  # bad arguments or input: invalid lines, refused URL or path, missing file (argparse too)
EXIT_TIMEOUT = 3  # a wait or a weight push ran out of time (the work may still finish)
EXIT_UNREACHABLE = 4  # Redis could not be reached; nothing was done
EXIT_INTERRUPTED = 130


class Command:
    """One `pipeline NAME` subcommand. Subclass it, set `name` and `help`, override both methods."""

    name: ClassVar[str]
    help: ClassVar[str]
    # True: the command talks to Redis and takes `--redis URL` and `--pool NAME` (added first).
    connects: ClassVar[bool] = False
    # With `connects`, what the command does with its pool (`check_pool` guards it before `run()`):
    # "names": it may be the first to name the pool (a submit, a worker, a weight push); it takes
    # `--new-pool`, and a never-named pool close to a known one's name is refused as a typo without it.
    # "reads": the pool must have been named (a never-named one is refused). "" (the default): not checked.
    pool_use: ClassVar[str] = ""

    def pool(self, args: argparse.Namespace) -> str | None:
        """The pool the command works in (None: every pool, or none)."""
        from pipeline.core import settings

        return args.pool or settings.pool()

    def new_pool(self, pool: str) -> None:
        """Said when the command names `pool` for the first time on this Redis (`pool_use` "names")."""
        print(f"note: pool {pool!r} is new on this Redis", file=sys.stderr)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the command's own options and positionals to its parser."""

    def run(self, args: argparse.Namespace) -> int | None:
        """Do the work; the exit code (None: 0). A `PipelineError` raised here is one `error: ...` line."""
        raise NotImplementedError(f"pipeline {self.name}: run() is not implemented")


class CommandGroup(Command):
    """A command made of subcommands, `pipeline NAME SUBNAME ...` (e.g. `pipeline weights push`).

    `commands` lists the subcommands' classes, each a `Command`; the one chosen is stored as
    `args.<name>_command`.
    """

    commands: ClassVar[tuple[type[Command], ...]]


def add_redis_options(parser: argparse.ArgumentParser, command: Command) -> None:
    """The connection options of a command with `connects = True`: `--redis URL` and `--pool NAME`
    (and `--new-pool` when the command may name a pool first)."""
    parser.add_argument("--redis", metavar="URL", default=None,
                        help="Redis URL (default: $PIPELINE_REDIS_URL, else the embedded server)")
    parser.add_argument("--pool", metavar="NAME", default=None,
                        help="the pool: its own queue, workers and control state (default: $PIPELINE_POOL, "
                             "else 'default')")
    if command.pool_use == "names":
        parser.add_argument("--new-pool", action="store_true",
                            help="the pool is new on purpose: go on even though its name is close to an "
                                 "existing pool's (without it, that is refused as a typo)")


def check_pool(command: Command, args: argparse.Namespace) -> None:
    """Refuse a mistyped pool before the command does anything (`Command.pool_use`): a never-named
    pool whose name is close to a known one's ("did you mean"; `--new-pool` when it is meant), and
    any never-named pool for a command that only reads one."""
    from pipeline.core.broker.connection import connect_redis
    from pipeline.core.broker.registry import unknown_pool
    from pipeline.core.errors import PipelineError

    if not command.connects or not command.pool_use:
        return
    pool = command.pool(args)
    if pool is None:
        return
    why = unknown_pool(connect_redis(args.redis), pool)
    if why is None:
        return
    if command.pool_use == "reads":
        raise PipelineError(why)
    if "did you mean" in why and not args.new_pool:
        raise PipelineError(f"{why}; nothing was done. A new pool of that name: add --new-pool")
    command.new_pool(pool)


def run_command(command: Command, args: argparse.Namespace) -> int | None:
    """`command.run(args)` once its pool passed `check_pool`."""
    check_pool(command, args)
    return command.run(args)


def add_command(sub: argparse._SubParsersAction, command: Command, *, arguments: bool = True) -> None:
    """Add `command` to a subparsers action, abbreviations off; `arguments=False` lists only its
    name and help (its module's heavy imports stay unloaded)."""
    parser = sub.add_parser(command.name, help=command.help, allow_abbrev=False)
    if not arguments:
        return
    if isinstance(command, CommandGroup):
        nested = parser.add_subparsers(dest=f"{command.name}_command", required=True)
        for subcommand in command.commands:
            add_command(nested, subcommand())
        return
    if command.connects:
        add_redis_options(parser, command)
    command.add_arguments(parser)
    parser.set_defaults(func=functools.partial(run_command, command))
