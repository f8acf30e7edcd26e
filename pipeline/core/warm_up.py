"""One-time work the first turn of a fresh process would otherwise pay, done as it starts.

pyarrow imports its pandas shim (pandas itself, when installed) the first time it makes an array
from Python or numpy values: about 0.3 s on a 2-core host. A fresh `pipeline serve` and `pipeline
worker` each made their first array on the first agent turn, which took 0.27 s against 0.01 s for
the turns after it (the sim at infinite speed); `warm_up` moves that into start-up.
"""

from __future__ import annotations


def warm_up() -> None:
    """Make the one-time imports a turn's first rows would make."""
    import pyarrow as pa

    pa.array([0])
