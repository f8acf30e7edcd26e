"""The chaos script's small configuration: random SIGKILLs and a Redis restart lose and duplicate nothing."""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import run


def test_kills_and_a_redis_restart_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    outcome = run(requests=2000, workers=4, batch_size=25, job_seconds=0.2, kills=6, kill_every=0.5,
                  restart_redis=True, seed=1, timeout=90, directory=tmp_path)
    print(outcome.line())
    assert outcome.kills >= 4 and outcome.redis_restarts == 1  # the batch may finish before the last kill
    assert outcome.failed_jobs == {}
    assert (outcome.requested, outcome.missing, outcome.duplicated) == (2400, 0, 0)
    assert outcome.rows == outcome.files_rows == 2400  # one shard per job, even for re-run jobs
