"""The chaos script's small configuration, run as a user runs it: random SIGKILLs and a Redis
restart lose and duplicate nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kills_and_a_redis_restart_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--requests", "2000", "--workers", "4",
         "--batch-size", "25", "--job-seconds", "0.2", "--kills", "6", "--kill-every", "0.5", "--restart-redis",
         "--seed", "1", "--timeout", "90", "--directory", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    print(outcome)
    assert outcome["kills"] >= 4 and outcome["redis_restarts"] == 1  # the batch may finish before the last kill
    assert outcome["failed_jobs"] == {}
    assert (outcome["requested"], outcome["missing"], outcome["duplicated"]) == (2400, 0, 0)
    assert outcome["rows"] == outcome["files_rows"] == 2400  # one shard per job, even for re-run jobs
