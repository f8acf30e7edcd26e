"""Chaos: worker processes SIGKILLed at random (and Redis restarted) while requests flow.

Starts a real redis-server on a loopback port with its own directory, `--workers` worker
processes (each a `RolloutWorker` around an in-process fake engine that takes
`--job-seconds` per job), submits `--requests` requests, then every `--kill-every` seconds
SIGKILLs a random worker mid-batch and starts a replacement; with `--restart-redis` it also
shuts Redis down once mid-run and starts it again on the same data. At the end it prints

    requested: N samples  rows: R  missing: M  duplicated: D  (... seconds)

counting rows in the committed shards (deduped by job id, as readers do) and, separately,
every Parquet file under the run's directory. Exit status 0 only for 0 missing, 0 duplicated.
The baseline is the same submit served without any kill, in the same process (`--baseline`).

    .venv/bin/python benchmarks/chaos.py [--requests 5000] [--workers 4] [--kills 8] [--restart-redis]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402
import redis  # noqa: E402

from pipeline.batch import Batch  # noqa: E402
from pipeline.connection import connect_redis  # noqa: E402
from pipeline.redis_server import RedisServer  # noqa: E402
from pipeline.submit import submit_requests  # noqa: E402
from schemas.request import RolloutRequest  # noqa: E402
from workers.engines.fake import FakeEngine  # noqa: E402


def run_worker(url: str, job_s: float) -> None:
    """One worker process (the target of `multiprocessing`)."""
    from workers.worker import RolloutWorker

    worker = RolloutWorker(
        connect_redis(url, reconnect_for_s=60), FakeEngine(delay_s=job_s),
        heartbeat_interval_s=0.5, maintenance_interval_s=1, stuck_after_s=3, control_poll_s=0.5,
    )
    worker.work(burst=False, with_scheduler=False, logging_level="ERROR")


@dataclass
class Outcome:
    requested: int
    rows: int
    missing: int
    duplicated: int
    files_rows: int
    kills: int
    redis_restarts: int
    failed_jobs: dict[str, str]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.duplicated == 0 and not self.failed_jobs

    def line(self) -> str:
        return (f"requested: {self.requested} samples  rows: {self.rows}  missing: {self.missing}  "
                f"duplicated: {self.duplicated}  (rows in files: {self.files_rows}, kills: {self.kills}, "
                f"redis restarts: {self.redis_restarts}, failed jobs: {len(self.failed_jobs)}, "
                f"{self.seconds:.1f} s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_requests(count: int, seed: int) -> list[RolloutRequest]:
    rng = random.Random(seed)
    return [
        RolloutRequest(id=f"c{i}", input_ids=[1 + (i + k) % 900 for k in range(1 + i % 7)],
                       sampling_params={"max_new_tokens": 1 + rng.randrange(4), "n": 1 + (i % 5 == 0)})
        for i in range(count)
    ]


def run(
    *, requests: int = 2000, workers: int = 4, batch_size: int = 25, job_seconds: float = 0.1,
    kills: int = 6, kill_every: float = 0.6, restart_redis: bool = False, seed: int = 0,
    timeout: float = 120.0, retries: int = 6, directory: Path | None = None,
) -> Outcome:
    """Run one chaos round and count what came out."""
    rng = random.Random(seed)
    work = Path(directory or tempfile.mkdtemp(prefix="chaos-"))
    server = RedisServer(work / "redis", port=_free_port(), appendfsync="always")
    url = server.ensure_started()
    context = mp.get_context("fork")
    processes: list[mp.process.BaseProcess] = []

    def start_worker() -> None:
        process = context.Process(target=run_worker, args=(url, job_seconds), daemon=True)
        process.start()
        processes.append(process)

    started = time.monotonic()
    killed = restarts = 0
    try:
        conn = connect_redis(url)
        wanted = make_requests(requests, seed)
        output = f"file://{work / 'shards'}"
        plan = submit_requests(conn, wanted, run="chaos", output=output, batch_size=batch_size, retries=retries)
        batch = Batch(conn, plan)
        for _ in range(workers):
            start_worker()
        deadline = time.monotonic() + timeout
        next_kill = time.monotonic() + kill_every
        while not batch.status().complete:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: batch not done after {timeout}s: {dict(batch.status().counts)}")
            if killed < kills and time.monotonic() >= next_kill:
                alive = [p for p in processes if p.is_alive()]
                victim = rng.choice(alive)
                os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
                victim.join()
                killed += 1
                start_worker()
                next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
                if restart_redis and restarts == 0 and killed == max(1, kills // 2):
                    server.stop()
                    time.sleep(0.5)
                    server.ensure_started()
                    restarts += 1
            time.sleep(0.05)
        failed = batch.failures()
        expected = Counter(f"{r.id}:{i}" for r in wanted for i in range(r.sampling_params.n))
        got = Counter(batch.read(columns=["rollout_id"]).column("rollout_id").to_pylist())
        files = sorted((work / "shards" / "chaos").glob("*.parquet"))
        files_rows = sum(pq.read_metadata(f).num_rows for f in files)
        return Outcome(
            requested=sum(expected.values()),
            rows=sum(got.values()),
            missing=sum((expected - got).values()),
            duplicated=sum((got - expected).values()) + sum(c - 1 for c in got.values() if c > 1),
            files_rows=files_rows,
            kills=killed,
            redis_restarts=restarts,
            failed_jobs=failed,
            seconds=time.monotonic() - started,
        )
    finally:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                process.join()
        with contextlib.suppress(redis.RedisError):
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs="?", type=int, default=None, help="number of requests (same as --requests)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--job-seconds", type=float, default=0.1)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=0.8)
    parser.add_argument("--restart-redis", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--baseline", action="store_true", help="first run the same load without kills")
    parser.add_argument("--directory", type=Path, default=None, help="Redis and shard directory (default: temp)")
    parser.add_argument("--json", action="store_true", help="print the outcome as one JSON line instead")
    args = parser.parse_args(argv)
    size = args.size or args.requests
    common = dict(requests=size, workers=args.workers, batch_size=args.batch_size, job_seconds=args.job_seconds,
                  seed=args.seed, timeout=args.timeout)
    if args.baseline:
        base = run(**common, kills=0)  # type: ignore[arg-type]
        print("baseline:", base.line(), flush=True)
    outcome = run(**common, kills=args.kills, kill_every=args.kill_every,  # type: ignore[arg-type]
                  restart_redis=args.restart_redis, directory=args.directory)
    print(json.dumps(dataclasses.asdict(outcome)) if args.json else outcome.line())
    if args.baseline:
        print(f"time ratio chaos/baseline: {outcome.seconds / base.seconds:.2f}")
    for job_id, reason in outcome.failed_jobs.items():
        print(f"  failed {job_id}: {reason}")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
