"""Checkpoints under chaos: generated tokens thrown away per worker SIGKILL, with and without them.

Starts a real redis-server and `--workers` worker processes (each a `RolloutWorker` around the sim
engine: lognormal output lengths, median `--median-tokens`, p99 `--p99-tokens`, a decode step every
`--step-ms`), submits `--requests` requests (`ignore_eos`, budget `--max-new-tokens`), then every
`--kill-every` seconds SIGKILLs the worker holding the most jobs and starts a replacement, `--kills`
times, and waits for every job to commit. Each worker publishes, every 50 ms, how many tokens its
engine has generated (the sim's busy slot-steps) and what its checkpoints cost; the tokens thrown
away are those generated minus those in the committed rows (a killed worker's last 50 ms are not
counted, the same for both arms).

The baseline is today's worker (`--checkpoint-every 0`: a dead worker's job is generated again from
its prompts); the other arm checkpoints every `--checkpoint-every` seconds. Both run in this
process, alternating, `--repeats` times each with the same requests and kill schedule; printed:
medians over the repeats with their range (min–max), the ratio of the medians, rows missing and
duplicated (both must be 0), and the checkpoint cost: payload bytes per checkpointed token, Redis
memory per checkpointed token (`MEMORY USAGE` of a job's checkpoint list written the way a worker
writes it), and Redis commands per second per worker. Figures are the sim's: a sim second is
`--step-ms` ms a token, far faster than a real engine's decode, so `--checkpoint-every 1` here is
like 10 s at 20 tokens/s per sequence.

    .venv/bin/python benchmarks/checkpoints.py [--requests 1500] [--workers 4] [--kills 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
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

import numpy as np  # noqa: E402
import redis  # noqa: E402

from benchmarks.common import free_port  # noqa: E402
from pipeline.core.broker import keys  # noqa: E402
from pipeline.core.broker.connection import connect_redis  # noqa: E402
from pipeline.core.broker.redis_server import RedisServer  # noqa: E402
from pipeline.runs.batch import Batch  # noqa: E402
from pipeline.submit.enqueue import submit_requests  # noqa: E402
from schemas.request import RolloutRequest  # noqa: E402
from workers.jobs.checkpoint import CheckpointStore  # noqa: E402
from workers.rows.continuation import Piece  # noqa: E402

STATS = "bench:checkpoints:workers"  # hash: worker id -> JSON of its figures
REPORT_S = 0.05


@dataclass(frozen=True)
class Setup:
    requests: int
    workers: int
    kills: int
    kill_every: float
    median_tokens: float
    p99_tokens: float
    max_new_tokens: int
    step_ms: float
    capacity: int
    batch_size: int
    checkpoint_every: float
    timeout: float


def run_worker(url: str, setup: Setup, checkpoint_every: float, worker_id: str) -> None:
    """One worker process (the target of `multiprocessing`); publishes its figures every 50 ms."""
    from workers.engines.sim.engine import SimConfig, SimEngine
    from workers.process.worker import RolloutWorker

    engine = SimEngine(SimConfig(capacity=setup.capacity, step_s=setup.step_ms / 1000,
                                 median_tokens=setup.median_tokens,
                                 p99_tokens=setup.p99_tokens, prefill_tokens_per_s=0))
    conn = connect_redis(url)
    worker = RolloutWorker(conn, engine, heartbeat_interval_s=0.5, maintenance_interval_s=1, stuck_after_s=3,
                           control_poll_s=0.5, worker_id=worker_id, checkpoint_every_s=checkpoint_every)
    started = time.monotonic()

    def publish() -> None:
        stats = worker.feeder.checkpoint_stats
        conn.hset(STATS, worker_id, json.dumps({
            "generated": engine.stats().busy_slot_steps, "seconds": time.monotonic() - started,
            "commands": stats.commands, "bytes": stats.bytes, "tokens": stats.tokens, "pieces": stats.pieces,
            "resumed_tokens": stats.resumed_tokens}))

    def report() -> None:
        while True:
            publish()
            time.sleep(REPORT_S)

    threading.Thread(target=report, daemon=True).start()
    worker.work(burst=False, with_scheduler=False, logging_level="ERROR")
    publish()


def make_requests(count: int, max_new_tokens: int) -> list[RolloutRequest]:
    return [RolloutRequest(id=f"r{i}", input_ids=[1 + i % 900, 2, 3], logprobs=0,
                           sampling_params={"max_new_tokens": max_new_tokens, "seed": i})
            for i in range(count)]


def jobs_held(conn: redis.Redis) -> Counter[str]:
    """Jobs in flight per live worker (its registry entry's current job is one; the started registry all)."""
    from rq.job import Job
    from rq.registry import StartedJobRegistry
    from rq.serializers import JSONSerializer

    ids = StartedJobRegistry(keys.pool().queue_name, connection=conn, serializer=JSONSerializer).get_job_ids()
    jobs = Job.fetch_many(ids, connection=conn, serializer=JSONSerializer)
    return Counter(job.worker_name for job in jobs if job is not None and job.worker_name)


def one_round(setup: Setup, checkpoint_every: float, work: Path, seed: int) -> dict[str, float]:
    """One chaos round; its figures."""
    rng = random.Random(seed)
    with RedisServer(work / "redis", port=free_port()) as server:
        url = server.url
        conn = connect_redis(url)
        context = mp.get_context("fork")
        processes: dict[str, mp.process.BaseProcess] = {}

        def start() -> None:
            name = f"w{len(processes)}"
            process = context.Process(target=run_worker, args=(url, setup, checkpoint_every, name), daemon=True)
            process.start()
            processes[name] = process

        for _ in range(setup.workers):
            start()
        requests = make_requests(setup.requests, setup.max_new_tokens)
        batch = Batch(conn, submit_requests(conn, requests, run="bench", output=f"file://{work / 'shards'}",
                                            batch_size=setup.batch_size, retries=setup.kills + 2))
        held_at_kill: list[int] = []
        for _ in range(setup.kills):
            time.sleep(setup.kill_every * (0.75 + 0.5 * rng.random()))
            held = {n: c for n, c in jobs_held(conn).items() if processes.get(n) and processes[n].is_alive()}
            if not held:
                break
            name = max(held, key=lambda n: held[n])
            processes[name].kill()
            processes[name].join()
            held_at_kill.append(held[name])
            start()
        batch.wait(timeout=setup.timeout)
        for process in processes.values():
            if process.is_alive():
                process.terminate()
        for process in processes.values():
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        table = batch.read(columns=["rollout_id", "completion_tokens", "resumed_at"])
        ids = table.column("rollout_id").to_pylist()
        kept = int(np.sum(table.column("completion_tokens").to_numpy()))
        figures = [json.loads(v) for v in conn.hgetall(STATS).values()]
        generated = sum(f["generated"] for f in figures)
        kills = len(held_at_kill)
        worker_s = sum(f["seconds"] for f in figures)
        ckpt_tokens = sum(f["tokens"] for f in figures)
        return {
            "kills": kills, "thrown_per_kill": (generated - kept) / max(1, kills), "generated": generated,
            "kept": kept, "missing": len({r.id for r in requests} - {i.split(":")[0] for i in ids}),
            "duplicated": len(ids) - len(set(ids)),
            "resumed_rows": len(ids) - table.column("resumed_at").null_count,
            "jobs_held_per_kill": statistics.mean(held_at_kill) if held_at_kill else 0.0,
            "bytes_per_token": sum(f["bytes"] for f in figures) / ckpt_tokens if ckpt_tokens else 0.0,
            "commands_per_s_per_worker": sum(f["commands"] for f in figures) / worker_s if worker_s else 0.0,
            "commands_per_ktoken": 1000 * sum(f["commands"] for f in figures) / generated if generated else 0.0,
            "bytes_per_generated_token": sum(f["bytes"] for f in figures) / generated if generated else 0.0,
        }


def redis_memory_per_token(work: Path, tokens: int = 4000, every: int = 200, top: int = 0) -> float:
    """Redis memory (`MEMORY USAGE`) per token of one sample's checkpoint, saved `every` tokens at a time."""
    with RedisServer(work / "memory", port=free_port()) as server:
        conn = connect_redis(server.url)
        store = CheckpointStore(conn)
        rng = np.random.default_rng(0)
        for start in range(0, tokens, every):
            ids = rng.integers(0, 150_000, every).astype(np.int32)
            tops = [[(int(t), -1.0)] * top for t in ids] if top else None
            store.save([("job", 1, [Piece((0, 0), start, 0, ids, -rng.exponential(1, every).astype(np.float32),
                                         tops)])])
        return float(conn.memory_usage(keys.checkpoint("job"), samples=0)) / tokens


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} (range {min(values):,.0f}–{max(values):,.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=3.0, metavar="S")
    parser.add_argument("--median-tokens", type=float, default=300)
    parser.add_argument("--p99-tokens", type=float, default=4000)
    parser.add_argument("--max-new-tokens", type=int, default=8000)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=float, default=1.0, metavar="S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    setup = Setup(args.requests, args.workers, args.kills, args.kill_every, args.median_tokens, args.p99_tokens,
                  args.max_new_tokens, args.step_ms, args.capacity, args.batch_size, args.checkpoint_every,
                  args.timeout)
    work = Path(tempfile.mkdtemp(prefix="checkpoints-"))
    rounds: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    for repeat in range(args.repeats):
        for arm, every in (("without", 0.0), ("with", args.checkpoint_every)):
            figures = one_round(setup, every, work / f"{arm}-{repeat}", seed=repeat)
            rounds[arm].append(figures)
            print(f"  round {repeat} {arm:>7} checkpoints: {json.dumps({k: round(v, 2) for k, v in figures.items()})}",
                  flush=True)
    print(f"sim engine, {args.workers} workers, {args.requests} requests (lognormal lengths: median "
          f"{args.median_tokens:g}, p99 {args.p99_tokens:g} tokens), a SIGKILL every ~{args.kill_every:g} s, "
          f"{args.repeats} rounds each arm (sim figures)")
    without = [r["thrown_per_kill"] for r in rounds["without"]]
    with_ = [r["thrown_per_kill"] for r in rounds["with"]]
    print(f"tokens thrown away per kill, without checkpoints (baseline): {spread(without)}")
    print(f"tokens thrown away per kill, checkpoints every {args.checkpoint_every:g} s: {spread(with_)}")
    ratio = statistics.median(without) / max(1.0, statistics.median(with_))
    print(f"  -> {ratio:.1f}x fewer (ratio of medians)")
    lost = sum(r["missing"] for arm in rounds.values() for r in arm)
    dup = sum(r["duplicated"] for arm in rounds.values() for r in arm)
    print(f"rows missing: {lost}, duplicated: {dup}; resumed rows per round (with): "
          f"{[int(r['resumed_rows']) for r in rounds['with']]}")
    bytes_per_token = statistics.median(r["bytes_per_token"] for r in rounds["with"])
    commands = [r["commands_per_s_per_worker"] for r in rounds["with"]]
    print(f"checkpoint cost: {bytes_per_token:.1f} payload bytes per checkpointed token (logprobs, no top logprobs); "
          f"Redis memory {redis_memory_per_token(work):.1f} B/token (a 4000-token sample saved 200 tokens at a "
          f"time; {redis_memory_per_token(work, top=5):.1f} B/token with 5 top logprobs); "
          f"{statistics.median(commands):.1f} Redis commands/s per worker (range {min(commands):.1f}–"
          f"{max(commands):.1f}); per generated token: "
          f"{statistics.median(r['bytes_per_generated_token'] for r in rounds['with']):.2f} bytes written, "
          f"{statistics.median(r['commands_per_ktoken'] for r in rounds['with']):.3f} commands per 1 000 tokens")
    return 0 if lost == 0 and dup == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
