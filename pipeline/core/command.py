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


def add_redis_options(parser: argparse.ArgumentParser) -> None:
    """The connection options of a command with `connects = True`: `--redis URL` and `--pool NAME`."""
    parser.add_argument("--redis", metavar="URL", default=None,
                        help="Redis URL (default: $PIPELINE_REDIS_URL, else the embedded server)")
    parser.add_argument("--pool", metavar="NAME", default=None,
                        help="the pool: its own queue, workers and control state (default: $PIPELINE_POOL, "
                             "else 'default')")


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
        add_redis_options(parser)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)
