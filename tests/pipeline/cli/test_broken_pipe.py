"""`pipeline show ... | head -c 100`: once the reader has gone, the command ends quietly (exit 0, nothing
on stderr), as `cat` does, for every command's output (`pipeline.cli.main.main` catches it once)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PIPELINE
from tests.pipeline.core.test_shards import job_table


def _read_100_bytes_then_leave(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    process = subprocess.Popen([*PIPELINE, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    assert len(process.stdout.read(100)) == 100
    process.stdout.close()  # as `head -c 100` exits
    err = process.stderr.read().decode()
    return process.wait(timeout=120), err


@pytest.mark.parametrize("argv", [["show", "{shards}", "--json"], ["show", "{shards}"]])
def test_a_command_whose_reader_went_away_exits_quietly(argv: list[str], pipeline_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    table = job_table("b-00000", 1, requests=1000)
    from workers.rows.shard_writer import write_shard

    write_shard(table, str(tmp_path / "out"), "step-1", "b-00000")  # ~1 MB of rows printed: past any pipe buffer
    code, err = _read_100_bytes_then_leave([a.format(shards=tmp_path / "out" / "step-1") for a in argv],
                                           pipeline_env)
    assert (code, err) == (0, "")
