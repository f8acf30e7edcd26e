"""Failover across hosts: from the master's host cut off to the next committed row, over N runs.

    sudo .venv/bin/python benchmarks/failover_hosts.py [--runs 10] [--requests 2000]

Each run makes a fresh fleet of hosts on this machine (network namespaces joined by a bridge:
tests/helpers/netns_fleet.py, root needed), with Redis as tests/test_fleet_network.py has it
(tests/helpers/fleet_redis.py): the master on one host, its replica on a second, three sentinels
(quorum 2, `down-after-milliseconds 1000`, `failover-timeout 5000`) on those two and a third, a
sim worker (`--sim-step-ms 10`, 32-token replies, batches of 8) on each of two more hosts, every
process reaching Redis by a Sentinel URL. `pipeline submit` of `--requests` requests from the third
host; once three shards are committed, the master's host is cut off (`ip link set ... down` at
the bridge). The figure: the first commit-log entry written after the cut, on the promoted master,
its stream id (the master's clock in ms; every host here shares this machine's clock) less the
moment the cut returned. It spans the sentinels' `down-after-milliseconds`, their election and
the promotion, the workers noticing and reconnecting through the sentinels, and a job finishing
and committing. Prints each run, then the median and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.core.broker import keys  # noqa: E402
from tests.conftest import PIPELINE  # noqa: E402
from tests.helpers import fleet_redis, netns_fleet  # noqa: E402
from tests.helpers.netns_fleet import Fleet, redis_binary  # noqa: E402
from tests.helpers.processes import wait_until  # noqa: E402

HOSTS = ["redis-a", "redis-b", "trainer", "gpu-1", "gpu-2"]
RUN = "failover"


def _first_commit_after(fleet: Fleet, ms: int) -> int | None:
    """The ms of the first commit-log entry after `ms` on the promoted master, if any yet."""
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-h", fleet.ip("redis-b"), "--raw", "xrange",
                                keys.commit_log(RUN), str(ms + 1), "+", "count", "1"])
    first = out.split("\n")[0].strip()
    return int(first.split("-")[0]) if first else None


def _commits(fleet: Fleet) -> int:
    out = fleet.run("trainer", [redis_binary("redis-cli"), "-h", fleet.ip("redis-a"), "xlen", keys.commit_log(RUN)])
    return int(out.strip() or 0)


def one_run(requests: int) -> tuple[float, float]:
    """Seconds from the master's host cut off to the sentinels naming the promoted replica (polled from
    the trainer's host), and to the next commit, in a fresh fleet."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        fleet = Fleet(HOSTS).up()
        try:
            fleet_redis.start_group(fleet, tmp_path, [])
            for host in ("gpu-1", "gpu-2"):
                fleet_redis.start_worker(fleet, tmp_path, host, heartbeat_s=0.5, sim_step_ms=10)
            path = tmp_path / "requests.jsonl"
            path.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": [5, 6, 7],
                                                "sampling_params": {"max_new_tokens": 32}}) + "\n"
                                    for i in range(requests)))
            fleet.run("trainer", [*PIPELINE, "submit", str(path), "--run", RUN, "--batch-size", "8"],
                      env=fleet_redis.pipeline_env(fleet, tmp_path), timeout=120)
            wait_until(lambda: _commits(fleet) >= 3, 120, "work under way")
            fleet.cut("redis-a")
            cut_ms = int(time.time() * 1000)
            wait_until(lambda: fleet_redis.master(fleet) == fleet.ip("redis-b"), 120, "the replica promoted")
            promoted = time.time() - cut_ms / 1000
            found: list[int] = []

            def committed() -> bool:
                first = _first_commit_after(fleet, cut_ms)
                found.extend([first] if first is not None else [])
                return bool(found)

            wait_until(committed, 120, "a commit on the promoted master")
            return promoted, (found[0] - cut_ms) / 1000
        finally:
            fleet.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    why = netns_fleet.unavailable()
    if why is not None:
        raise SystemExit(f"cannot make hosts here: {why}")
    promoted, seconds = [], []
    for run in range(args.runs):
        started = time.monotonic()
        promotion, commit = one_run(args.requests)
        promoted.append(promotion)
        seconds.append(commit)
        print(f"run {run + 1}: {commit:.2f} s from the cut to the next commit, the replica promoted after "
              f"{promotion:.2f} s (the run took {time.monotonic() - started:.0f} s)", flush=True)
    print(f"failover across hosts, {len(seconds)} runs: the cut to the next commit median "
          f"{statistics.median(seconds):.2f} s, "
          f"max {max(seconds):.2f} s (min {min(seconds):.2f} s); the cut to the sentinels naming the promoted "
          f"replica median {statistics.median(promoted):.2f} s, max {max(promoted):.2f} s")

if __name__ == "__main__":
    main()
