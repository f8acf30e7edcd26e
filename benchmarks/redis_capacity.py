"""Redis capacity: commands, bytes and server CPU per job, per idle worker-second and per weight push.

Starts a real redis-server on a loopback port and `--workers` worker processes (each a
`RolloutWorker` around the fake engine, with the default heartbeat, maintenance and control
intervals), then measures from Redis's own counters (`INFO commandstats`, `INFO stats`,
`INFO cpu`; `CONFIG RESETSTAT` before each phase):

0. the server alone for half of `--idle-seconds`: its own housekeeping, subtracted from the idle phase;
1. idle: the workers waiting on an empty queue for `--idle-seconds`: per worker-second;
2. jobs: `--jobs` jobs of `--requests-per-job` requests (default 64, of `--prompt-tokens` 512 random
   ids: the prompt ids are staged in Redis beside each job) each submitted and served: per job (the
   enqueue, the prompt ids staged and read, the dequeue, the job's status writes, its commit, its
   finish), the idle workers' share over the same time subtracted;
3. pushes: `--pushes` weight pushes to all workers: per push per worker.

It prints one table of the three and the top commands of the job phase; `docs/scaling.md` turns
the figures into a capacity model. The baseline in the same process is the idle phase: the job
figure is also given as a multiple of one idle worker-second.

    .venv/bin/python benchmarks/redis_capacity.py [--workers 30] [--jobs 600] [--idle-seconds 20]
        [--requests-per-job 64] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402

from pipeline.core.broker import control_channel, registry  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.runs.batch import Batch  # noqa: E402
from pipeline.submit.enqueue import submit_requests  # noqa: E402
from schemas.request import RolloutRequest  # noqa: E402

VOCAB = 151_936


def run_worker(url: str, worker_id: str) -> None:
    """One worker process with the default intervals (the target of `multiprocessing`)."""
    from dataclasses import replace

    from pipeline.core.broker.connection import connect_redis
    from schemas.worker_info import Capabilities
    from workers.engines.fake import FakeEngine
    from workers.process.worker import RolloutWorker

    engine = FakeEngine()
    # A real model's vocabulary (the fake's is 1 000): prompt ids above 65 535 are staged as int32.
    engine._description = replace(engine._description, capabilities=Capabilities(vocab_size=VOCAB))
    RolloutWorker(connect_redis(url), engine, worker_id=worker_id).work(
        burst=False, with_scheduler=False, logging_level="ERROR")


@dataclass
class Usage:
    """What Redis did between two snapshots."""

    commands: int
    bytes_in: int
    bytes_out: int
    cpu_s: float
    seconds: float
    top: list[tuple[str, int]]

    def per(self, n: float) -> tuple[float, float, float]:
        return self.commands / n, (self.bytes_in + self.bytes_out) / n, self.cpu_s / n


def snapshot(conn: redis.Redis) -> tuple[dict[str, int], int, int, float, float]:
    stats = conn.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    net, cpu = conn.info("stats"), conn.info("cpu")
    return (calls, int(net["total_net_input_bytes"]), int(net["total_net_output_bytes"]),
            float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), time.monotonic())


def usage(conn: redis.Redis, before: tuple[dict[str, int], int, int, float, float]) -> Usage:
    after = snapshot(conn)
    calls = {k: v - before[0].get(k, 0) for k, v in after[0].items()}
    calls["info"] = calls.get("info", 0) - 3  # our own snapshot
    top = sorted(((k, v) for k, v in calls.items() if v > 0), key=lambda kv: -kv[1])[:8]
    return Usage(sum(calls.values()), after[1] - before[1], after[2] - before[2], after[3] - before[3],
                 after[4] - before[4], top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=30)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--requests-per-job", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="tokens a prompt (random ids of a 151 936 vocabulary: staged in Redis as int32)")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args(argv)
    context = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        before = snapshot(conn)
        time.sleep(args.idle_seconds / 2)
        alone = usage(conn, before)  # the server's own housekeeping (cron, fsync): not the workers'
        processes = [context.Process(target=run_worker, args=(server.url, f"cap-{i}"), daemon=True)
                     for i in range(args.workers)]
        for process in processes:
            process.start()
        try:
            deadline = time.monotonic() + 120
            while len(registry.live_workers(conn)) < args.workers:
                if time.monotonic() > deadline:
                    raise RuntimeError("workers did not register within 120 s")
                time.sleep(0.2)
            time.sleep(3.0)  # past the start-up writes
            before = snapshot(conn)
            time.sleep(args.idle_seconds)
            idle = usage(conn, before)
            idle.cpu_s -= alone.cpu_s * idle.seconds / alone.seconds
            idle_ws = args.workers * idle.seconds

            rng = np.random.default_rng(0)
            requests = [RolloutRequest(id=f"r{i}", input_ids=rng.integers(0, VOCAB, args.prompt_tokens).tolist(),
                                       sampling_params={"max_new_tokens": args.max_new_tokens})
                        for i in range(args.jobs * args.requests_per_job)]
            before = snapshot(conn)
            plan = submit_requests(conn, requests, run="capacity", output=f"file://{tmp}/shards",
                                   batch_size=args.requests_per_job)
            batch = Batch(conn, plan)
            while not batch.status().complete:
                time.sleep(0.2)
            jobs = usage(conn, before)
            idle_share = args.workers * jobs.seconds / idle_ws  # idle traffic during the job phase, in idle units
            per_job = [(j - i * idle_share) / len(plan.job_ids)
                       for j, i in zip((jobs.commands, jobs.bytes_in + jobs.bytes_out, jobs.cpu_s),
                                       (idle.commands, idle.bytes_in + idle.bytes_out, idle.cpu_s), strict=True)]

            before = snapshot(conn)
            for version in range(1, args.pushes + 1):
                control_channel.push_weights(conn, f"/weights/v{version}", version, timeout=120)
            pushes = usage(conn, before)
            push_share = args.workers * pushes.seconds / idle_ws
            per_push = [(p - i * push_share) / (args.pushes * args.workers)
                        for p, i in zip((pushes.commands, pushes.bytes_in + pushes.bytes_out, pushes.cpu_s),
                                        (idle.commands, idle.bytes_in + idle.bytes_out, idle.cpu_s), strict=True)]
        finally:
            for process in processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                    process.join()

    idle_per = idle.per(idle_ws)
    print(f"{args.workers} workers; {len(plan.job_ids)} jobs of {args.requests_per_job} requests of "
          f"{args.prompt_tokens}-token prompts, {args.max_new_tokens} new tokens; "
          f"{args.pushes} pushes; Redis on a unix socket; server alone: "
          f"{alone.cpu_s / alone.seconds * 1e6:.0f} µs CPU per second")
    print(f"{'unit':<34} {'commands':>9} {'bytes':>9} {'server CPU':>12}")
    print(f"{'idle worker, per second':<34} {idle_per[0]:>9.2f} {idle_per[1]:>9.0f} {idle_per[2] * 1e6:>9.1f} µs")
    print(f"{'job (one shard, one commit)':<34} {per_job[0]:>9.1f} {per_job[1]:>9.0f} {per_job[2] * 1e6:>9.1f} µs")
    print(f"{'weight push, per worker':<34} {per_push[0]:>9.1f} {per_push[1]:>9.0f} {per_push[2] * 1e6:>9.1f} µs")
    print(f"job / idle worker-second (CPU): {per_job[2] / idle_per[2]:.1f}x")
    print("job phase, top commands:", ", ".join(f"{k} {v / len(plan.job_ids):.1f}/job" for k, v in jobs.top))
    print("idle phase, top commands:", ", ".join(f"{k} {v / idle_ws:.2f}/worker-s" for k, v in idle.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
