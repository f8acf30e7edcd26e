"""The chaos script's small configurations, run as a user runs it: random SIGKILLs (and a Redis
restart, and SIGKILLs of the Redis master under Sentinel) lose and duplicate nothing, with one job
per worker and with several jobs in flight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.processes import wait_until

ROOT = Path(__file__).resolve().parents[1]


def chaos(tmp_path: Path, *args: str) -> dict[str, Any]:
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seed", "1", "--timeout", "120",
         "--directory", str(tmp_path), "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # SIGTERM: the script stops every process it started
        process.terminate()
        stdout, stderr = process.communicate(timeout=30)
        raise AssertionError(f"chaos.py did not finish within 300 s:\n{stdout}{stderr}") from None
    assert process.returncode == 0, stdout + stderr
    outcome = json.loads(stdout.strip().splitlines()[-1])
    print(outcome)
    return outcome


def assert_exactly_once(outcome: dict[str, Any], requested: int) -> None:
    assert outcome["failed_jobs"] == {}
    assert (outcome["requested"], outcome["missing"], outcome["duplicated"]) == (requested, 0, 0)
    assert outcome["rows"] == outcome["files_rows"] == requested  # one shard per job, even for re-run jobs
    # The raw commit log: every job committed, a re-run one possibly twice (its reader keeps the last).
    assert outcome["committed_jobs"] == outcome["jobs"] <= outcome["commit_entries"]
    # A kill mid-write can leave a temporary file (never read: readers follow the commit log), at most
    # one per job the killed worker held.
    assert outcome["temp_files"] <= sum(outcome["in_flight_at_kills"])


def test_kills_and_a_redis_restart_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    outcome = chaos(tmp_path, "--requests", "2000", "--workers", "4", "--batch-size", "25", "--job-seconds", "0.2",
                    "--kills", "6", "--kill-every", "0.5", "--restart-redis")
    assert outcome["kills"] >= 4 and outcome["redis_restarts"] == 1  # the batch may finish before the last kill
    assert_exactly_once(outcome, 2400)


def test_kills_of_workers_holding_several_jobs_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """The concurrent sim engine: each worker feeds several jobs at once, and each kill takes the
    worker holding the most."""
    outcome = chaos(tmp_path, "--engine", "sim", "--step-seconds", "0.05", "--requests", "2000", "--workers", "3",
                    "--batch-size", "25", "--kills", "4", "--kill-every", "0.5")
    assert outcome["kills"] >= 2
    assert max(outcome["in_flight_at_kills"]) >= 2, outcome["in_flight_at_kills"]
    assert_exactly_once(outcome, 2400)


def test_sigkilled_redis_masters_fail_over_under_sentinel_and_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """A master, two replicas and three sentinels; everyone reaches Redis through a `redis+sentinel://`
    URL. The master is SIGKILLed three times while sim workers run jobs (each time with a part of the
    requests submitted while it is down, once in the middle of a weight push): workers and the
    submitter follow each failover without a restart, every request still has exactly one row, a
    follower received every shard once, `pipeline status` adds up and every worker serves the
    pushed weights. The sentinels judge a master down after 3 s: at 1 s a busy machine (CI's) stalls
    a live master or a sentinel that long, a few times in ten runs, and they fail over from it as
    well, which is the next test's subject, not this one's (and which can still lose a write made in
    the second after such a promotion by a client that counted no replica, docs/failover.md)."""
    outcome = chaos(tmp_path, "--engine", "sim", "--step-seconds", "0.05", "--requests", "1200", "--workers", "3",
                    "--batch-size", "25", "--kills", "1", "--kill-every", "1", "--kill-master", "3",
                    "--push-during-kill", "--down-after-ms", "3000")
    assert outcome["master_kills"] == 3 and len(outcome["recovery_s"]) == 3
    assert len(outcome["pushes"]) == 1 and "failed" not in outcome["pushes"][0], outcome["pushes"]
    assert outcome["desired_version"] == 1 and set(outcome["weight_versions"].values()) == {1}, outcome
    assert_exactly_once(outcome, 1440)
    assert outcome["followed"] == outcome["followed_distinct"] == outcome["jobs"]  # the follower: each shard once
    # `pipeline status` on the last master: nothing queued, running or failed; one shard per job, every row.
    assert outcome["status"] == {"queued": 0, "retrying": 0, "started": 0, "failed": 0,
                                 "shards": outcome["jobs"], "rows": 1440}, outcome["status"]


def test_masters_demoted_while_they_still_answer_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """The sentinels fail over from a master that still runs (`SENTINEL FAILOVER`, as an operator
    does, and as the sentinels do to a master too busy to answer their pings for a second), twice
    while sim workers run jobs: the old master answers, and takes writes, until the sentinels turn
    it into a replica, which drops them. Each such write (a submit, commits) is noticed against the
    master the sentinels name and made again there: every request still has exactly one row. (Before,
    a write acknowledged by a master whose replicas had left counted as kept: the run stalled with
    the submit and commits gone.)"""
    outcome = chaos(tmp_path, "--engine", "sim", "--step-seconds", "0.05", "--requests", "800", "--workers", "3",
                    "--batch-size", "25", "--kills", "0", "--kill-master", "2", "--demote")
    assert outcome["master_kills"] == 2
    assert_exactly_once(outcome, 960)
    assert outcome["followed"] == outcome["followed_distinct"] == outcome["jobs"]
    assert outcome["status"] == {"queued": 0, "retrying": 0, "started": 0, "failed": 0,
                                 "shards": outcome["jobs"], "rows": 960}, outcome["status"]


def _processes_under(directory: Path) -> list[int]:
    """Live processes whose working directory lies under `directory` (Redis servers run in their data dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if (proc / "cwd").resolve().is_relative_to(directory):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_chaos_run_stopped_by_sigterm_leaves_no_redis_process(tmp_path: Path) -> None:
    """A test's or a shell's timeout SIGTERMs the script mid-run: its cleanup still stops the Sentinel
    group (every server and sentinel) and its workers."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--directory", str(tmp_path), "--engine", "sim",
         "--requests", "100000", "--workers", "1", "--kills", "0", "--kill-master", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # Mid-run: the group up (3 servers, 3 sentinels), the worker committing shards.
        wait_until(lambda: any((tmp_path / "shards" / "chaos").glob("*.parquet")), timeout=120, what="a shard")
        assert len(_processes_under(tmp_path)) == 6
        process.terminate()
        process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode != 0
    assert _processes_under(tmp_path) == []
