"""One way to add a command: every `pipeline` subcommand is a `Command` found through the
`pipeline.commands` entry point group; only the command being run gets its arguments (so the
trainer's commands never load the GPU side); option abbreviations are off everywhere."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from pipeline.cli import main as cli
from pipeline.core.command import EXIT_TIMEOUT, EXIT_USAGE, Command, CommandGroup
from pipeline.core.errors import PipelineError

ROOT = Path(__file__).resolve().parents[3]

COMMANDS = {"submit", "status", "show", "report", "cancel", "pause", "resume", "weights", "redis",
            "worker", "reward-worker", "verify", "demo"}

# Run `pipeline ARGV...` in a fresh interpreter, then list the heavy or GPU-side modules it loaded.
_LOADED = (
    "import sys\n"
    "from pipeline.cli.main import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'sglang', 'vllm')\n"
    "               or m.startswith(('workers.engines', 'workers.process', 'workers.audit')))\n"
    "print('LOADED', *heavy, file=sys.stderr)\n"
)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _every_parser(parser: argparse.ArgumentParser, path: str = "pipeline") -> dict[str, argparse.ArgumentParser]:
    found = {path: parser}
    for name, child in _subparsers(parser).items():
        found |= _every_parser(child, f"{path} {name}")
    return found


def test_every_command_is_a_command_from_the_entry_point_group_under_its_own_name() -> None:
    entries = list(entry_points(group=cli.ENTRY_POINT_GROUP))
    assert {entry.name for entry in entries} >= COMMANDS
    for entry in entries:
        command = entry.load()
        assert isinstance(command, type) and issubclass(command, Command), entry
        assert command.name == entry.name and command.help, entry
    assert set(_subparsers(cli.build_parser())) == {entry.name for entry in entries}
    weights = _subparsers(cli.build_parser())["weights"]
    assert set(_subparsers(weights)) == {"push", "status"}


@pytest.mark.parametrize(
    "argv", [["--help"], ["submit", "--help"], ["status", "--help"], ["weights", "push", "--help"]], ids=" ".join)
def test_trainer_side_commands_load_no_torch_transformers_or_gpu_side_module(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", _LOADED, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert "usage: pipeline" in done.stdout, done.stderr
    loaded = next(line for line in done.stderr.splitlines() if line.startswith("LOADED")).split()[1:]
    assert loaded == [], f"pipeline {' '.join(argv)} loaded {loaded[:8]}"


def test_the_worker_command_gets_its_arguments_only_when_it_runs() -> None:
    """`pipeline worker --help` does load the engine options (the control case of the test above)."""
    done = subprocess.run([sys.executable, "-c", _LOADED, "worker", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "--engine {" in done.stdout, done.stderr
    assert "workers.engines.factory" in done.stderr


def test_option_abbreviations_are_off_on_every_command_and_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _every_parser(cli.build_parser())
    assert {"pipeline", "pipeline worker", "pipeline weights", "pipeline weights push"} <= set(parsers)
    assert [path for path, parser in parsers.items() if parser.allow_abbrev] == []
    with pytest.raises(SystemExit) as usage:
        cli.main(["worker", "--engin", "sim"])
    assert usage.value.code == EXIT_USAGE
    assert "unrecognized arguments: --engin" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli.main(["weights", "push", "/ckpt", "--vers", "3"])
    assert usage.value.code == EXIT_USAGE


@pytest.mark.parametrize(("argv", "typo", "suggested"), [(["submitt", "x.jsonl"], "submitt", "submit"),
                                                         (["weights", "pusj"], "pusj", "push"),
                                                         (["worker", "--engine", "vlm-http"], "vlm-http", "vllm-http")])
def test_a_mistyped_command_or_choice_is_a_usage_error_that_suggests_the_closest(
        argv: list[str], typo: str, suggested: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        cli.main(argv)
    assert usage.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"invalid choice: '{typo}'" in err and err.rstrip().endswith(f"; did you mean {suggested!r}?")


@pytest.mark.parametrize(("argv", "suggested", "usage_of"), [
    (["submit", "r.jsonl", "--rn", "x"], "--run", "pipeline submit"),
    (["status", "--jsn"], "--json", "pipeline status"),
    (["cancel", "--run=x", "--pol=a"], "--pool", "pipeline cancel"),
    (["submit", "r.jsonl", "--n-samples", "2"], "--n", "pipeline submit"),  # other tools' names, as for fields
    (["submit", "r.jsonl", "--max-tokens", "8"], "--max-new-tokens", "pipeline submit"),
    (["weights", "push", "/ckpt", "--version", "3", "--forse"], "--force", "pipeline weights push"),
])
def test_a_mistyped_option_is_a_usage_error_that_suggests_the_commands_closest(
        argv: list[str], suggested: str, usage_of: str, capsys: pytest.CaptureFixture[str]) -> None:
    """...and prints the usage of the command it was given to, not the top level's list of commands."""
    with pytest.raises(SystemExit) as usage:
        cli.main(argv)
    assert usage.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and err.rstrip().endswith(f"; did you mean {suggested!r}?")
    assert err.startswith(f"usage: {usage_of} [-h]") and f"\n{usage_of}: error: " in err


def test_the_worker_usage_error_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PIPELINE_HOME": str(tmp_path), "PIPELINE_REDIS_URL": "redis://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "worker", "--engin", "sim", "--burst"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "error: unrecognized arguments: --engin" in done.stderr


class _Echo(Command):
    """A command as a package would add one (here handed to main in place of the entry points)."""

    name = "echo"
    help = "print the pool, or fail as told"
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--fail", choices=["none", "timeout", "error"], default="none")

    def run(self, args: argparse.Namespace) -> int | None:
        print(f"pool={args.pool} redis={args.redis}")
        if args.fail == "timeout":
            return EXIT_TIMEOUT
        if args.fail == "error":
            raise PipelineError("told to fail")
        return None


class _Pair(CommandGroup):
    name = "pair"
    help = "a group of two"
    commands = (_Echo,)


def test_a_command_runs_through_the_one_protocol(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "commands", lambda: [_Echo(), _Pair()])
    assert cli.main(["echo", "--pool", "p1", "--redis", "redis://h:1"]) == 0
    assert capsys.readouterr().out == "pool=p1 redis=redis://h:1\n"
    assert cli.main(["echo", "--fail", "timeout"]) == EXIT_TIMEOUT
    assert cli.main(["pair", "echo", "--fail", "error"]) == EXIT_USAGE
    assert capsys.readouterr().err == "error: told to fail\n"
    with pytest.raises(SystemExit) as usage:  # a group needs its subcommand
        cli.main(["pair"])
    assert usage.value.code == EXIT_USAGE


def test_a_mistyped_file_to_submit_names_the_closest_file_and_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REDIS_URL", "redis://127.0.0.1:1")  # never reached: nothing is connected
    (tmp_path / "rollouts.jsonl").write_text("")
    assert cli.main(["submit", str(tmp_path / "rollout.jsonl")]) != 0
    err = capsys.readouterr().err
    assert f"error: no such file: {tmp_path / 'rollout.jsonl'}; did you mean 'rollouts.jsonl'?" in err
    assert cli.main(["submit", str(tmp_path / "gone" / "r.jsonl"), "--agent", "m:f"]) != 0
    assert "(its directory" in capsys.readouterr().err
