"""One-time work the first turn of a fresh process would otherwise pay, done as it starts.

pyarrow imports its pandas shim (pandas itself, when installed) the first time it makes an array
from Python or numpy values: about 0.3 s on a 2-core host. A fresh `pipeline serve` and `pipeline
worker` each made their first array on the first agent turn, which took 0.27 s against 0.01 s for
the turns after it (the sim at infinite speed); `warm_up` moves that into start-up.

`freeze_start_up` then takes what start-up made out of the garbage collector's view: the imported
modules, the tokenizer and its template, some 300 000 objects in `pipeline serve`, which live as
long as the process. Each full collection walked all of them again (about 0.24 s on a 2-core host,
every few seconds under load: 0.8 ms of a turn's CPU). Only a process's own entry point calls it,
as it is about to serve: a process that goes on making and dropping objects it started with (a
test session) would keep their cycles for good.
"""

from __future__ import annotations

import gc


def warm_up() -> None:
    """Make the one-time imports a turn's first rows would make."""
    import pyarrow as pa

    pa.array([0])


def freeze_start_up() -> None:
    """Collect once, then move every object alive into the collector's permanent generation
    (`gc.freeze`): they are never walked again, so a full collection costs what the process made since."""
    gc.collect()
    gc.freeze()
