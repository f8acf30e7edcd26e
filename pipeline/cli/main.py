"""The `pipeline` command line: parse, dispatch to the chosen command, map its errors to exit codes.

Every subcommand is a `pipeline.core.command.Command`, found through the `pipeline.commands`
entry point group (pyproject.toml): `pipeline`'s own (jobs_commands, control_commands,
inspect_commands, redis_command) and those the `workers` package contributes (worker,
reward-worker, verify, demo), so `pipeline` never imports `workers`. Only the command being
run gets its arguments added: `pipeline submit` loads no GPU-side module.

Every command that talks to Redis takes `--redis URL` (default `$PIPELINE_REDIS_URL`, else the
embedded server) and `--pool NAME` (default `$PIPELINE_POOL`, else `default`; `status` without
either lists every pool). Option abbreviations are off everywhere (`--engin` is a usage error).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

import redis

from pipeline.core import settings
from pipeline.core.broker.connection import is_unavailable
from pipeline.core.command import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    Command,
    add_command,
)
from pipeline.core.errors import (
    JobsFailedError,
    NoShardsError,
    PipelineError,
    UnknownRunError,
    WaitTimeoutError,
    WeightPushError,
)
from pipeline.core.suggest import OTHER_NAMES, did_you_mean

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_TIMEOUT", "EXIT_UNREACHABLE", "EXIT_USAGE", "build_parser",
           "commands", "exit_code", "main"]

ENTRY_POINT_GROUP = "pipeline.commands"


def exit_code(exc: BaseException) -> int:
    """The exit code for an error that ended a command."""
    if isinstance(exc, WeightPushError):
        return EXIT_TIMEOUT if exc.timed_out and not exc.failed else EXIT_FAILED
    if isinstance(exc, JobsFailedError | NoShardsError | UnknownRunError):
        return EXIT_FAILED
    if isinstance(exc, WaitTimeoutError):
        return EXIT_TIMEOUT
    if is_unavailable(exc):
        return EXIT_UNREACHABLE
    return EXIT_USAGE


def commands() -> list[Command]:
    """Every installed command, in the order of the entry point group (by name)."""
    return [entry.load()() for entry in entry_points(group=ENTRY_POINT_GROUP)]


class Parser(argparse.ArgumentParser):
    """argparse's parser, adding "did you mean" to an unknown command or choice (subcommands'
    parsers are of the same class: `add_subparsers` makes its parsers with the parent's)."""

    def error(self, message: str) -> NoReturn:
        invalid = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if invalid:
            message += did_you_mean(invalid.group(1), re.findall(r"'([^']*)'", invalid.group(2)))
        unknown = re.match(r"unrecognized arguments: (.*)$", message)
        if unknown:  # found by the top parser, about the command's options: the command's usage
            command = self._command_parser()
            message += _closest_option(unknown.group(1).split(), command)
            argparse.ArgumentParser.error(command, message)
        super().error(message)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def _command_parser(self) -> argparse.ArgumentParser:
        """The parser of the command named on the command line, the innermost (`weights push`'s), else this one."""
        parser: argparse.ArgumentParser = self
        for word in (w for w in getattr(self, "_argv", []) if not w.startswith("-")):
            subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subparsers or word not in subparsers[0].choices:
                break
            parser = subparsers[0].choices[word]
        return parser


def _closest_option(words: list[str], parser: argparse.ArgumentParser) -> str:
    """"did you mean" for the first unknown option among `parser`'s, other tools' names included
    (`--n-samples`: `--n`)."""
    known = [o for a in parser._actions for o in a.option_strings]
    flags = {f"--{other}".replace("_", "-"): f"--{ours}".replace("_", "-") for other, ours in OTHER_NAMES.items()}
    aliases = {flag: ours for flag, ours in flags.items() if ours in known}
    return next((did_you_mean(w.split("=")[0], known, aliases=aliases) for w in words if w.startswith("-")), "")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; with `only`, just the command so named gets its arguments
    (the others are listed by name and help, their modules' heavy imports left unloaded)."""
    parser = Parser(
        prog="pipeline", description="Token-exact LLM rollouts over Redis/RQ into Parquet.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands():
        add_command(sub, command, arguments=only is None or command.name == only)
    return parser


def _chosen(argv: Sequence[str]) -> str:
    """The command named on a command line: its first word that is not an option ('' if none)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(only=_chosen(argv)).parse_args(argv)
        settings.control_secret()  # a control key file that is not there: an error now, not at the first control read
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of its output went away (`pipeline show RUN | head`): done, quietly
        _drop_stdout()
        return 0
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"error: cannot reach Redis ({exc}); start the embedded one with `pipeline redis start`, "
              "or pass --redis URL / set PIPELINE_REDIS_URL; nothing was done", file=sys.stderr)
        return exit_code(exc)
    except redis.ResponseError as exc:
        if not is_unavailable(exc):
            raise
        print(f"error: Redis refused the command for PIPELINE_REDIS_RECONNECT_S ({exc}): it is without its "
              "replicas, its master or its data (docs/failover.md); run the command again once it has them",
              file=sys.stderr)
        return exit_code(exc)
    except OSError as exc:  # a file named on the command line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush meets no broken pipe either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
