"""Chaos: worker processes SIGKILLed at random (and Redis restarted) while requests flow.

Starts a real redis-server on a loopback port with its own directory, `--workers` worker
processes (each a `RolloutWorker` around an in-process engine: `--engine fake`, one job at a
time taking `--job-seconds`; or `--engine sim`, the concurrent simulated engine, each worker
feeding several jobs at once, a step every `--step-seconds`), submits `--requests` requests,
then every `--kill-every` seconds SIGKILLs a worker mid-batch (with `sim`, the one holding the
most jobs in flight) and starts a replacement; with `--restart-redis` it also shuts Redis down
once mid-run and starts it again on the same data. With `--kill-master N` Redis is instead a
Sentinel group (a master, two replicas, three sentinels: `tests.helpers.sentinel_group`) that everyone
reaches through a `redis+sentinel://` URL; N times it SIGKILLs whichever server is master while
jobs run (the requests go in N + 1 parts: the first at the start, each other right after a kill,
while the master is down; with `--push-during-kill` the second kill lands in the middle of a weight
push; with `--demote` the master is not killed but demoted by `SENTINEL FAILOVER`, and it answers,
taking writes the promotion loses, until the sentinels make it a replica), prints the seconds from
the kill to the first commit after it, counts the shards a follower (started at the first submit)
received, and restarts the dead server as a replica. At the end it
prints

    requested: N samples  rows: R  missing: M  duplicated: D  (... seconds)

counting rows in the committed shards (deduped by job id, as readers do) and, separately,
every Parquet file under the run's directory, the raw commit-log entries (a job re-run after
its commit appends a second one), the temporary shard files left behind, and how many jobs
each killed worker held. Exit status 0 only for 0 missing, 0 duplicated, no failed job or weight
push, and every live worker on the weight version of the pool's (durable) control state.
The baseline is the same submit served without any kill, in the same process (`--baseline`).

    .venv/bin/python benchmarks/chaos.py [--requests 5000] [--workers 4] [--kills 8] [--restart-redis]
                                         [--engine sim] [--kill-master 5]
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
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402
import redis  # noqa: E402
from rq.job import Job  # noqa: E402
from rq.registry import StartedJobRegistry  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from benchmarks.common import free_port  # noqa: E402
from pipeline.audit.status import collect  # noqa: E402
from pipeline.core.broker import commit_log, control_channel, keys, registry  # noqa: E402
from pipeline.core.broker.connection import connect_redis  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.core.errors import EmbeddedRedisError, PipelineError  # noqa: E402
from pipeline.read.follow import Follower  # noqa: E402
from pipeline.runs.batch import Batch  # noqa: E402
from pipeline.submit.enqueue import submit_requests  # noqa: E402
from schemas.request import RolloutRequest  # noqa: E402
from tests.helpers.sentinel_group import SentinelGroup  # noqa: E402
from workers.engines.fake import FakeEngine  # noqa: E402

ALL_REPLICAS_WAIT_S = 15.0  # before a master kill: how long to wait for every replica to be in sync


def run_worker(url: str, job_s: float, engine: str, step_s: float, worker_id: str) -> None:
    """One worker process (the target of `multiprocessing`)."""
    from workers.engines.sim.engine import SimConfig, SimEngine
    from workers.process.worker import RolloutWorker

    if engine == "sim":  # every sequence runs its max_new_tokens steps (median far above them)
        chosen: object = SimEngine(SimConfig(capacity=64, step_s=step_s, median_tokens=10_000, p99_tokens=10_001))
    else:
        chosen = FakeEngine(delay_s=job_s)
    worker = RolloutWorker(
        connect_redis(url, reconnect_for_s=60), chosen,  # type: ignore[arg-type]
        heartbeat_interval_s=0.5, maintenance_interval_s=1, stuck_after_s=3, control_poll_s=0.5,
        worker_id=worker_id,
    )
    worker.work(burst=False, with_scheduler=False, logging_level="ERROR")


def jobs_in_flight(conn: redis.Redis) -> Counter[str]:
    """Started jobs per worker name (RQ's started registry and each job's worker)."""
    queue = keys.pool().queue_name
    ids = StartedJobRegistry(queue, connection=conn, serializer=JSONSerializer).get_job_ids()
    jobs = Job.fetch_many(ids, connection=conn, serializer=JSONSerializer)
    return Counter(job.worker_name for job in jobs if job is not None and job.worker_name)


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
    jobs: int = 0
    commit_entries: int = 0  # raw commit-log entries: jobs + re-commits of re-run jobs
    committed_jobs: int = 0  # distinct job ids among them
    temp_files: int = 0  # temporary shard files left by writes a kill interrupted
    in_flight_at_kills: list[int] = dataclasses.field(default_factory=list)  # jobs the victim held
    master_kills: int = 0
    recovery_s: list[float] = dataclasses.field(default_factory=list)  # master kill -> first commit after it
    pushes: list[str] = dataclasses.field(default_factory=list)  # weight pushes a master kill interrupted
    weight_versions: dict[str, int] = dataclasses.field(default_factory=dict)  # live workers' at the end
    desired_version: int = 0  # the pool's weight version in the (durable) control state at the end
    status: dict[str, int] = dataclasses.field(default_factory=dict)  # `pipeline status`: queue and run totals
    followed: int = 0  # shards a follower started at the first submit received (with --kill-master)
    followed_distinct: int = 0  # of them, distinct jobs of the batches

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.duplicated == 0 and not self.failed_jobs and \
            not any("failed" in push for push in self.pushes) and \
            all(version == self.desired_version for version in self.weight_versions.values())

    def line(self) -> str:
        return (f"requested: {self.requested} samples  rows: {self.rows}  missing: {self.missing}  "
                f"duplicated: {self.duplicated}  (rows in files: {self.files_rows}, kills: {self.kills}, "
                f"redis restarts: {self.redis_restarts}, failed jobs: {len(self.failed_jobs)}, "
                f"commit entries: {self.commit_entries} for {self.committed_jobs} of {self.jobs} jobs, "
                f"temp files left: {self.temp_files}, jobs held by each victim: {self.in_flight_at_kills}, "
                f"master kills: {self.master_kills}, seconds from each to the next commit: "
                f"{[round(r, 2) for r in self.recovery_s]}, weight pushes during a master kill: {self.pushes}, "
                f"workers' weight versions: {sorted(self.weight_versions.values())} (the pool's: "
                f"{self.desired_version}), "
                f"{self.seconds:.1f} s)")



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
    timeout: float = 120.0, retries: int = 6, directory: Path | None = None, engine: str = "fake",
    step_seconds: float = 0.05, kill_master: int = 0, push_during_kill: bool = False, demote: bool = False,
    down_after_ms: int = 1000,
) -> Outcome:
    """Run one chaos round and count what came out."""
    rng = random.Random(seed)
    work = Path(directory or tempfile.mkdtemp(prefix="chaos-"))
    group = SentinelGroup(work / "sentinel", replicas=2, password="chaos", down_after_ms=down_after_ms,
                                                  appendfsync="always") if kill_master else None
    server = RedisServer(work / "redis", port=free_port(), appendfsync="always")
    url = group.start() if group else server.ensure_started()
    context = mp.get_context("fork")
    processes: list[mp.process.BaseProcess] = []

    names: dict[str, mp.process.BaseProcess] = {}

    def start_worker() -> None:
        name = f"chaos-{len(processes)}"
        process = context.Process(target=run_worker, args=(url, job_seconds, engine, step_seconds, name), daemon=True)
        process.start()
        processes.append(process)
        names[name] = process

    def victim() -> tuple[mp.process.BaseProcess, int]:
        """A random live worker; with the concurrent engine the one holding the most jobs (waiting
        a moment for one that holds two or more)."""
        alive = [p for p in processes if p.is_alive()]
        if engine != "sim":
            return rng.choice(alive), 1
        until = time.monotonic() + 2.0
        while True:
            held = {n: c for n, c in jobs_in_flight(conn).items() if n in names and names[n].is_alive()}
            if held and (max(held.values()) >= 2 or time.monotonic() > until):
                name = max(held, key=lambda n: held[n])
                return names[name], held[name]
            if not held and time.monotonic() > until:
                return rng.choice(alive), 0
            time.sleep(0.01)

    started = time.monotonic()
    killed = restarts = 0
    in_flight_at_kills: list[int] = []
    recovery_s: list[float] = []
    pushes: list[str] = []
    try:
        conn = connect_redis(url)
        wanted = make_requests(requests, seed)
        output = f"file://{work / 'shards'}"
        # With --kill-master N: N + 1 parts, the first submitted now, each other right after a kill
        # (while the master is down), so every kill is followed by jobs still to run.
        parts = [wanted[i * len(wanted) // (kill_master + 1):(i + 1) * len(wanted) // (kill_master + 1)]
                 for i in range(kill_master + 1)] if group else [wanted]
        batches = [Batch(conn, submit_requests(conn, parts[0], run="chaos", output=output, batch_size=batch_size,
                                               retries=retries))]
        followed: list[str] = []  # job ids a trainer's follower received, through every failover
        follower = None
        all_submitted = threading.Event()  # the last part is submitted (after the last master kill)

        def follow_the_run() -> None:
            """A trainer's follower: a Follower ends once every batch submitted so far has ended, so one
            started before the last part is submitted iterates again (same cursor, same seen jobs)
            until that part is in."""
            trainer = Follower(connect_redis(url), "chaos", raise_on_failure=False)
            while True:
                submitted = all_submitted.is_set()
                followed.extend(shard.job_id for shard in trainer)
                if submitted:
                    return
                all_submitted.wait(0.1)

        if group:
            follower = threading.Thread(target=follow_the_run, daemon=True)
            follower.start()
        else:
            all_submitted.set()

        def kill_the_master() -> None:
            """SIGKILL the master mid-run, submit the next part while it is down, time the recovery.

            The kill comes once half of the jobs of the last part submitted have committed (distinct
            jobs: a re-run job commits again), so it lands while jobs run."""
            assert group is not None
            # Every replica in sync first (the restarted one too) where that comes soon: whichever the
            # sentinels promote then has the data (Sentinel may promote a replica still catching up, and
            # its master's newer writes are lost); at least one in any case.
            try:
                group.wait_ready(timeout=min(ALL_REPLICAS_WAIT_S, max(1.0, deadline - time.monotonic())))
            except EmbeddedRedisError:
                group.wait_ready(replicas=1, timeout=max(1.0, deadline - time.monotonic()))
            goal = sum(len(b.job_ids) for b in batches) - len(batches[-1].job_ids) // 2
            while conn.hlen(keys.run_jobs("chaos")) < goal and time.monotonic() < deadline:
                time.sleep(0.01)
            commits = conn.xlen(keys.commit_log("chaos"))
            push = None
            if push_during_kill and len(recovery_s) == 1:  # the second kill lands in a weight push
                push = threading.Thread(target=push_weights, args=(len(recovery_s),), daemon=True)
                push.start()
            dead = group.demote_master() if demote else group.kill_master()
            killed_at = time.monotonic()
            batches.append(Batch(conn, submit_requests(conn, parts[len(batches)], run="chaos", output=output,
                                                       batch_size=batch_size, retries=retries)))
            if len(batches) == len(parts):
                all_submitted.set()
            while conn.xlen(keys.commit_log("chaos")) <= commits:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chaos: no commit within {timeout}s after the master on port {dead} "
                                       f"{'was demoted' if demote else 'died'}")
                time.sleep(0.01)
            recovery_s.append(time.monotonic() - killed_at)
            print(f"master on port {dead} {'demoted' if demote else 'killed'}; {recovery_s[-1]:.2f} s to the next "
                  f"commit (master now on port {group.master_port()})", file=sys.stderr)
            if not demote:
                group.restart(dead)  # a replica again once the sentinels notice; the other replica takes the next kill
            if push is not None:
                push.join()

        def push_weights(version: int) -> None:
            try:
                result = control_channel.push_weights(conn, f"/weights/v{version}", version, timeout=60)
                pushes.append(f"v{version}: {sum(a.ok for a in result.acks)} of {len(result.acks)} workers loaded")
            except PipelineError as error:
                pushes.append(f"v{version}: failed: {error}")

        def complete() -> bool:
            return all(b.status().complete for b in batches)

        for _ in range(workers):
            start_worker()
        deadline = time.monotonic() + timeout
        next_kill = time.monotonic() + kill_every
        while not complete() or len(recovery_s) < kill_master:
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: batch not done after {timeout}s: "
                                   f"{[dict(b.status().counts) for b in batches]}")
            if len(recovery_s) < kill_master:
                kill_the_master()
            if killed < kills and time.monotonic() >= next_kill:
                target, held = victim()
                os.kill(target.pid, signal.SIGKILL)  # type: ignore[arg-type]
                target.join()
                in_flight_at_kills.append(held)
                killed += 1
                start_worker()
                next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
                if restart_redis and restarts == 0 and killed == max(1, kills // 2):
                    server.stop()
                    time.sleep(0.5)
                    server.ensure_started()
                    restarts += 1
            time.sleep(0.05)
        if follower is not None:
            follower.join(timeout=max(1.0, deadline - time.monotonic()))
        failed = {job: reason for b in batches for job, reason in b.failures().items()}
        expected = Counter(f"{r.id}:{i}" for r in wanted for i in range(r.sampling_params.n))
        got = Counter(rid for b in batches for rid in b.read(columns=["rollout_id"]).column("rollout_id").to_pylist())
        files = sorted((work / "shards" / "chaos").glob("*.parquet"))
        files_rows = sum(pq.read_metadata(f).num_rows for f in files)
        entries = commit_log.read_after(conn, "chaos", None)
        pool_status = collect(conn, run="chaos")["pools"][keys.pool(None).name]  # what `pipeline status` shows
        # Jobs whose end a dead master lost stay "started" until maintenance finds them abandoned, then
        # wait out their retry backoff ("retrying") and run again, rewriting the same shard: let them settle.
        settle = time.monotonic() + 30
        while (any(pool_status["queue"][state] for state in ("queued", "retrying", "started"))
               and time.monotonic() < settle):
            time.sleep(0.5)
            pool_status = collect(conn, run="chaos")["pools"][keys.pool(None).name]
        temp_files = [p for p in (work / "shards" / "chaos").glob(".*") if ".tmp-" in p.name]
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
            jobs=sum(len(b.job_ids) for b in batches),
            commit_entries=len(entries),
            committed_jobs=len({e.job_id for e in entries}),
            temp_files=len(temp_files),
            in_flight_at_kills=in_flight_at_kills,
            master_kills=len(recovery_s),
            recovery_s=recovery_s,
            pushes=pushes,
            weight_versions={w.worker_id: w.weight_version for w in registry.live_workers(conn)},
            desired_version=control_channel.read_state(conn).weight_version,
            status={**{k: v for k, v in pool_status["queue"].items() if k != "name"},
                    **{k: pool_status["runs"]["chaos"][k] for k in ("shards", "rows")}},
            followed=len(followed),
            followed_distinct=len(set(followed) & {j for b in batches for j in b.job_ids}),
        )
    finally:  # also on a timeout, an error or SIGTERM (`main`): nothing it started outlives it
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                process.join()
        if group:
            group.stop()
        else:
            with contextlib.suppress(redis.RedisError):
                server.stop()


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP (a test's or a shell's timeout) end the run through its cleanup: every worker
    process, the Redis server and the Sentinel group it started are stopped."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("size", nargs="?", type=int, default=None, help="number of requests (same as --requests)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--job-seconds", type=float, default=0.1, help="fake engine: seconds per job")
    parser.add_argument("--engine", choices=("fake", "sim"), default="fake",
                        help="fake: one job at a time per worker; sim: concurrent, several jobs in flight")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="sim engine: seconds per decode step")
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=0.8)
    parser.add_argument("--restart-redis", action="store_true")
    parser.add_argument("--kill-master", type=int, default=0,
                        help="run Redis as a Sentinel group and SIGKILL its master this many times")
    parser.add_argument("--push-during-kill", action="store_true",
                        help="with --kill-master 2 or more: the second kill lands in a weight push")
    parser.add_argument("--demote", action="store_true",
                        help="with --kill-master: demote the master (SENTINEL FAILOVER) instead of killing it")
    parser.add_argument("--down-after-ms", type=int, default=1000,
                        help="with --kill-master: the sentinels' down-after-milliseconds (a busy machine can stall a "
                             "live master or a sentinel that long, and the sentinels then fail over from it too)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--baseline", action="store_true", help="first run the same load without kills")
    parser.add_argument("--directory", type=Path, default=None, help="Redis and shard directory (default: temp)")
    parser.add_argument("--json", action="store_true", help="print the outcome as one JSON line instead")
    args = parser.parse_args(argv)
    size = args.size or args.requests
    common = dict(requests=size, workers=args.workers, batch_size=args.batch_size, job_seconds=args.job_seconds,
                  seed=args.seed, timeout=args.timeout, engine=args.engine, step_seconds=args.step_seconds)
    if args.baseline:
        base = run(**common, kills=0)  # type: ignore[arg-type]
        print("baseline:", base.line(), flush=True)
    outcome = run(**common, kills=args.kills, kill_every=args.kill_every,  # type: ignore[arg-type]
                  restart_redis=args.restart_redis, directory=args.directory, kill_master=args.kill_master,
                  push_during_kill=args.push_during_kill, demote=args.demote, down_after_ms=args.down_after_ms)
    print(json.dumps(dataclasses.asdict(outcome)) if args.json else outcome.line())
    if args.baseline:
        print(f"time ratio chaos/baseline: {outcome.seconds / base.seconds:.2f}")
    for job_id, reason in outcome.failed_jobs.items():
        print(f"  failed {job_id}: {reason}")
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
