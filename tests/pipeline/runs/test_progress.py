"""A wait's progress: a bar only on a terminal, a line per 10 % elsewhere."""

from __future__ import annotations

import io

from pipeline.runs.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_one_line_per_ten_percent() -> None:
    stream = io.StringIO()
    progress = Progress(40, "step-1", show=True, stream=stream)
    for done in range(41):
        progress.update(done, rows=done * 2, failed=0)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [f"step-1: {p}% ({p * 40 // 100}/40 jobs, {p * 40 // 100 * 2} rows, 0 failed)"
                     for p in range(0, 101, 10)]


def test_a_terminal_gets_the_bar_and_nothing_shows_when_off() -> None:
    terminal = Terminal()
    progress = Progress(4, "step-1", show=True, stream=terminal)
    progress.update(2, rows=5, failed=1)
    progress.close()
    assert "\r" in terminal.getvalue() and "2/4" in terminal.getvalue()
    quiet = io.StringIO()
    off = Progress(4, "step-1", show=False, stream=quiet)
    off.update(4, rows=5, failed=0)
    off.close()
    assert quiet.getvalue() == ""
