"""Reward functions the tests register through `$PIPELINE_REWARDS` (never through the queue)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def length(rows: list[dict]) -> list[tuple[float, dict]]:
    """The completion's length in tokens, with the request id as info."""
    return [(float(len(row["completion_token_ids"])), {"request": row["request_id"]}) for row in rows]


def broken(rows: list[dict]) -> list[float]:
    raise RuntimeError("the grader crashed on purpose")


def stalls(rows: list[dict]) -> list[float]:
    """`length`, except that with $STALL_MARKER set its second call creates that file and hangs (a
    worker to kill mid-shard)."""
    marker = os.environ.get("STALL_MARKER")
    if marker:
        calls = Path(marker + ".calls")
        calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
        if calls.read_text() == "2":
            Path(marker).touch()
            time.sleep(3600)
    return [float(len(row["completion_token_ids"])) for row in rows]


def varies(rows: list[dict]) -> list[float]:
    """The sample index's parity for requests whose metadata says `vary`, else 0: a group's rewards
    differ exactly when its request varies."""
    return [float(row["sample_index"] % 2) if row["metadata"].get("vary") else 0.0 for row in rows]
