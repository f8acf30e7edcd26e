"""Pools and capability routing: isolation between pools, and a mixed pool served without waste.

    .venv/bin/python benchmarks/pools.py [--rounds 3] [--requests 256] [--mixed 180]

1. Isolation. Two pools, `actor` and `ref`, on one redis-server, each with 2 sim worker
   processes (capacity 32, 10 ms steps, lognormal lengths median 40 / p99 200 tokens, weight
   load 0.3 s). The figure is pool ref's throughput (requests/s over a batch of `--requests`)
   while pool actor serves its own jobs and takes weight pushes, pauses and resumes back to back,
   against ref's solo throughput (actor's workers up and idle) measured in the same process;
   rounds alternate solo/disturbed, medians are compared. Goal: ratio >= 0.95.
2. Mixed pool. One pool, 3 sim worker processes: dense without top-k, dense with
   `--max-top-logprobs 5`, and MoE (routed experts, 2 layers, top-2 of 8), serving a mixed
   request file (a third plain, a third top-5 logprobs, a third routed experts). Counted: failed
   jobs, and wasted executions (jobs started on a worker that then could not serve them: no
   shard); hand-backs before running are counted apart (a dequeue, nothing run). Baseline, same
   process, same submit, its own pool: today's workers, which run whatever they dequeue (no check
   before running, a refusal fails the job). Also printed: how many jobs today's submit (file-order
   packing, 8 requests a job) would have enqueued that no single worker can serve at all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

import pipeline
from pipeline.core.broker import registry
from pipeline.core.broker.redis_server import RedisServer
from pipeline.core.errors import JobsFailedError
from schemas.capabilities import job_needs, missing
from schemas.request import RolloutRequest
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.process.worker import RolloutWorker

SIM = {"capacity": 32, "step_s": 0.010, "median_tokens": 40, "p99_tokens": 200, "load_s": 0.3, "vocab_size": 1000}
KINDS = {"dense": {}, "dense-top5": {"max_top_logprobs": 5}, "moe": {"experts": (2, 2, 8)}}
MIXED_BATCH = 8


class CountingWorker(RolloutWorker):
    """The shipped worker, counting the jobs it passed over (handed back before running anything)."""

    passes = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        route = self.intake.route

        def counted(job: Any, queue: Any) -> Any:
            decision = self._route(job, queue, route)
            if decision != "run":
                self.passes += 1
            return decision

        self.intake.route = counted  # type: ignore[method-assign]

    def _route(self, job: Any, queue: Any, route: Any) -> Any:
        return route(job, queue)


class TodayWorker(CountingWorker):
    """The worker as it was before capability routing: it runs whatever it dequeues, and a
    request it cannot serve fails the job."""

    def _route(self, job: Any, queue: Any, route: Any) -> Any:
        return "run"

    def _hand_back_refused(self, job: Any, queue: Any, execution: Any, exc: BaseException) -> bool:
        return False


def _serve(url: str, pool: str, worker_id: str, kind: str, today: bool, results: Any) -> None:
    engine = SimEngine(SimConfig(**{**SIM, **KINDS[kind]}))  # type: ignore[arg-type]
    cls = TodayWorker if today else CountingWorker
    worker = cls(redis.Redis.from_url(url), engine, worker_id=worker_id, pool=pool, control_poll_s=0.1,
                 heartbeat_interval_s=1)
    try:
        worker.work(burst=False, with_scheduler=False, logging_level="CRITICAL")
    finally:
        engine.close()
    sample = worker.metrics.registry.get_sample_value
    labels = {"worker": worker_id, "engine": "sim"}
    counts = {outcome: int(sample("pipeline_worker_jobs_total", {**labels, "outcome": outcome}) or 0)
              for outcome in ("finished", "failed", "retried", "handed_back")}
    results.put({"worker": worker_id, "passes": worker.passes, **counts})


class Fleet:
    """Worker processes, stopped with SIGTERM (warm shutdown); each reports its counts."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ctx = mp.get_context("fork")
        self.results = self.ctx.Queue()
        self.processes: list[Any] = []

    def start(self, conn: redis.Redis, pool: str, kinds: list[str], *, today: bool = False) -> None:
        for i, kind in enumerate(kinds):
            process = self.ctx.Process(target=_serve, args=(self.url, pool, f"{pool}-{kind}-{i}", kind, today,
                                                            self.results), daemon=True)
            process.start()
            self.processes.append(process)
        while len(registry.live_workers(conn, pool)) < len(kinds):
            time.sleep(0.05)

    def stop(self) -> list[dict[str, Any]]:
        for process in self.processes:
            os.kill(process.pid, signal.SIGTERM)
        counts = [self.results.get(timeout=120) for _ in self.processes]
        for process in self.processes:
            process.join(timeout=30)
        self.processes = []
        return counts


def _requests(count: int, tag: str, seed: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"{tag}-{i}", "input_ids": [1 + (i * 7 + k) % 900 for k in range(16)],
             "sampling_params": {"max_new_tokens": 400, "seed": seed * 100_000 + i}} for i in range(count)]


def _timed(client: pipeline.Client, requests: list[dict[str, Any]], run: str, output: str) -> float:
    started = time.perf_counter()
    batch = client.submit(requests, run=run, output=output, batch_size=16)
    batch.wait(timeout=600)
    return len(requests) / (time.perf_counter() - started)


def isolation(conn: redis.Redis, fleet: Fleet, output: str, rounds: int, count: int) -> None:
    fleet.start(conn, "actor", ["dense", "dense"])
    fleet.start(conn, "ref", ["dense", "dense"])
    actor = pipeline.Client(conn, pool="actor")
    ref = pipeline.Client(conn, pool="ref")
    solo: list[float] = []
    disturbed: list[float] = []
    changes = {"pushes": 0, "pauses": 0}
    for r in range(rounds):
        solo.append(_timed(ref, _requests(count, f"solo{r}", r), f"ref-solo-{r}", output))
        stop = threading.Event()

        def disturb(r: int = r, stop: threading.Event = stop) -> None:
            step = 0
            while not stop.is_set():
                actor.submit(_requests(32, f"actor{r}-{step}", 1000 + step), run=f"actor-{r}", output=output,
                             batch_size=16)
                version = actor.control_state().weight_version + 1
                actor.push_weights(f"/weights/v{version}", version=version, timeout=60)
                changes["pushes"] += 1
                actor.pause()
                time.sleep(0.2)
                actor.resume()
                changes["pauses"] += 1
                step += 1

        thread = threading.Thread(target=disturb)
        thread.start()
        try:
            disturbed.append(_timed(ref, _requests(count, f"dist{r}", r), f"ref-disturbed-{r}", output))
        finally:
            stop.set()
            thread.join()
    fleet.stop()
    solo_m, disturbed_m = statistics.median(solo), statistics.median(disturbed)
    print(f"isolation: pool ref {disturbed_m:.1f} requests/s while pool actor took {changes['pushes']} weight "
          f"pushes and {changes['pauses']} pause/resume cycles, vs {solo_m:.1f} requests/s solo "
          f"(medians of {rounds}; 2+2 sim workers, one redis-server)")
    print(f"  ratio disturbed/solo: {disturbed_m / solo_m:.3f} (goal >= 0.95); rounds solo "
          f"{[round(x, 1) for x in solo]}, disturbed {[round(x, 1) for x in disturbed]}")


def _mixed_requests(count: int) -> list[dict[str, Any]]:
    lines = []
    for i in range(count):
        kind = i % 3
        lines.append({"id": f"m{i}", "input_ids": [1 + (i * 5 + k) % 900 for k in range(12)],
                      "sampling_params": {"max_new_tokens": 200, "seed": i},
                      "logprobs": 5 if kind == 1 else 0, "return_routed_experts": kind == 2})
    return lines


def _unservable_in_file_order(lines: list[dict[str, Any]]) -> tuple[int, int]:
    """Jobs of today's file-order packing that no single worker kind can serve."""
    classes = [SimEngine(SimConfig(**{**SIM, **k})).description.served for k in KINDS.values()]  # type: ignore[arg-type]
    chunks = [lines[i:i + MIXED_BATCH] for i in range(0, len(lines), MIXED_BATCH)]
    bad = 0
    for chunk in chunks:
        needs = job_needs(RolloutRequest.model_validate(line) for line in chunk)
        bad += all(missing(needs, c) for c in classes)
    return bad, len(chunks)


def mixed(conn: redis.Redis, fleet: Fleet, output: str, count: int) -> None:
    lines = _mixed_requests(count)
    outcome = {}
    for label, pool, today in (("today", "mixed-today", True), ("routed", "mixed", False)):
        fleet.start(conn, pool, list(KINDS), today=today)
        client = pipeline.Client(conn, pool=pool)
        started = time.perf_counter()
        batch = client.submit(lines, run=f"mixed-{label}", output=output, batch_size=MIXED_BATCH)
        try:
            batch.wait(timeout=600)
            failed = 0
        except JobsFailedError as exc:
            failed = len(exc.failures)
        seconds = time.perf_counter() - started
        counts = fleet.stop()
        outcome[label] = {
            "jobs": len(batch.job_ids), "failed": failed, "seconds": seconds,
            "wasted": sum(c["failed"] + c["retried"] + c["handed_back"] for c in counts),
            "passes": sum(c["passes"] for c in counts),
            "finished": sum(c["finished"] for c in counts),
        }
    for label, o in outcome.items():
        print(f"mixed pool ({label}): {o['jobs']} jobs of {count} requests, {o['failed']} failed, "
              f"{o['wasted']} wasted executions, {o['passes']} hand-backs before running, "
              f"{o['finished']} finished, {o['seconds']:.1f} s")
    bad, total = _unservable_in_file_order(lines)
    print(f"  today's submit (file-order packing) would also have enqueued {bad} of {total} jobs no single worker "
          "can serve (they fail wherever they run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=256, help="requests per timed batch of pool ref")
    parser.add_argument("--mixed", type=int, default=180, help="requests in the mixed file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = server.client()
        fleet = Fleet(server.url)
        output = f"file://{tmp}/shards"
        isolation(conn, fleet, output, args.rounds, args.requests)
        mixed(conn, fleet, output, args.mixed)


if __name__ == "__main__":
    main()
