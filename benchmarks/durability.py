"""What each AOF fsync policy of the embedded Redis costs and keeps, on this workload.

    .venv/bin/python benchmarks/durability.py [--kills 3] [--lone 300] [--writers 16] [--seconds 3]

For `always`, `everysec` and `no`, on a real `redis-server` as the embedded default runs it (unix
socket, AOF on, the policy under test), with the write an agent turn makes when it is committed
(one MULTI/EXEC: the session hash, a 2 KiB row appended to the turn log stream, two counters):

- cost: the latency of one such write alone (median and p99 of `--lone`), and writes/s from
  `--writers` concurrent writers for `--seconds`; the ratio of each against `always` (the old
  default) in the same run;
- a Redis crash: a writer commits numbered turns as fast as it can, the server is SIGKILLed at a
  random moment `--kills` times, restarted from its AOF, and every turn whose commit was
  acknowledged is looked for; the number missing is printed (what the policy loses when Redis,
  not the machine, dies);
- an OS crash or a power cut cannot be staged in a container: what each policy can lose then is
  what was acknowledged but not yet fsynced, printed as a window (`always`: none; `everysec`: the
  last second, two when an fsync runs late, which Redis counts in `aof_delayed_fsync`; `no`: the
  kernel's dirty-page expiry, read from /proc) times the measured commit rate.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import percentile  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402

POLICIES = ("always", "everysec", "no")
ROW = b"x" * 2048  # a turn's row in the turn log: ids, logprobs, text, about 2 KiB


def commit(conn: redis.Redis, n: int) -> None:
    """The write that commits turn `n` (the shape of `pipeline.serve.sessions.Sessions.record` and the
    turn log's append): one transaction."""
    with conn.pipeline(transaction=True) as pipe:
        pipe.hset(f"session:{n % 64}", mapping={"last": n, "turns": n})
        pipe.xadd("turns", {"n": n, "row": ROW})
        pipe.hincrby("stats", "turns", 1)
        pipe.expire(f"session:{n % 64}", 3600)
        pipe.execute()


def cost(server: RedisServer, lone: int, writers: int, seconds: float) -> tuple[list[float], float]:
    conn = server.client()
    latencies = []
    for n in range(lone):
        started = time.perf_counter()
        commit(conn, n)
        latencies.append(time.perf_counter() - started)
    done = [0] * writers
    stop = threading.Event()

    def write(index: int) -> None:
        own = server.client()
        n = 0
        while not stop.is_set():
            commit(own, index * 10_000_000 + n)
            n += 1
        done[index] = n

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return latencies, sum(done) / (time.perf_counter() - started)


def crash(server: RedisServer, rng: random.Random) -> tuple[int, int]:
    """Acknowledged commits, and how many of them a SIGKILL of the server lost."""
    acknowledged = []
    stop = threading.Event()

    def write() -> None:
        conn = server.client()
        n = 0
        while not stop.is_set():
            try:
                commit(conn, n)
            except (redis.ConnectionError, redis.TimeoutError):
                return
            acknowledged.append(n)
            n += 1

    thread = threading.Thread(target=write)
    thread.start()
    time.sleep(1.0 + rng.random())
    pid = int((server.directory / "redis.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    stop.set()
    thread.join()
    while server.is_running():
        time.sleep(0.01)
    server.ensure_started()
    conn = server.client()
    kept = {int(fields[b"n"]) for _, fields in conn.xrange("turns")}
    conn.flushall()
    return len(acknowledged), sum(1 for n in acknowledged if n not in kept)


def dirty_expiry_s() -> float:
    path = Path("/proc/sys/vm/dirty_expire_centisecs")
    writeback = Path("/proc/sys/vm/dirty_writeback_centisecs")
    if not path.exists():
        return float("nan")
    return (int(path.read_text()) + int(writeback.read_text())) / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--lone", type=int, default=300)
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            server = RedisServer(Path(tmp) / policy, appendfsync=policy)
            with server:
                lone, rate = cost(server, args.lone, args.writers, args.seconds)
                delayed = server.client().info("persistence").get("aof_delayed_fsync", 0)
                server.client().flushall()
                kills = [crash(server, rng) for _ in range(args.kills)]
            results[policy] = (lone, rate, kills, delayed)
    base_lone = statistics.median(results["always"][0])
    base_rate = results["always"][1]
    window = {"always": 0.0, "everysec": 1.0, "no": dirty_expiry_s()}
    print(f"\none turn's commit (MULTI/EXEC: HSET, XADD 2 KiB, HINCRBY, EXPIRE), unix socket, {args.lone} alone; "
          f"{args.writers} writers for {args.seconds:g} s; {args.kills} SIGKILLs of redis-server per policy")
    print(f"{'policy':<9} {'lone p50':>9} {'p99':>8} {'vs always':>9} {'commits/s':>10} {'vs always':>9} "
          f"{'Redis crash: lost of acknowledged':>34} {'OS crash/power cut: window':>27}")
    for policy, (lone, rate, kills, delayed) in results.items():
        p50 = statistics.median(lone)
        lost = ", ".join(f"{lost} of {acked}" for acked, lost in kills)
        at_risk = window[policy]
        late = f" (+1 s late: {delayed} fsyncs ran late)" if policy == "everysec" and delayed else ""
        risk = "none" if at_risk == 0 else f"{at_risk:.0f} s ~ {at_risk * rate:,.0f} commits{late}"
        print(f"{policy:<9} {p50 * 1000:>7.2f}ms {percentile(lone, 0.99) * 1000:>6.2f}ms {p50 / base_lone:>8.2f}x "
              f"{rate:>10,.0f} {rate / base_rate:>8.2f}x {lost:>34} {risk:>27}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
