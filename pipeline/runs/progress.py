"""A wait's progress: a tqdm bar on a terminal, else one plain line at each 10 % (logs stay readable)."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Jobs done out of `total`; `show=False` prints nothing."""

    def __init__(self, total: int, desc: str, *, show: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.desc = desc
        terminal = self.stream.isatty()
        self.bar = tqdm(total=total, unit="job", desc=desc, file=self.stream) if show and terminal else None
        self.lines = show and not terminal
        self._tenth = -1  # the last 10 % step printed

    def update(self, done: int, rows: int, failed: int) -> None:
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix(rows=rows, failed=failed)
            self.bar.refresh()
        elif self.lines:
            tenth = done * 10 // self.total if self.total else 10
            if tenth > self._tenth:
                self._tenth = tenth
                print(f"{self.desc}: {tenth * 10}% ({done}/{self.total} jobs, {rows} rows, {failed} failed)",
                      file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
