"""Worker overhead: completion tokens/s a worker turns into committed shards with an engine of
infinite speed, end to end per job, against a plain RQ + pyarrow pipeline; shard footprint.

    .venv/bin/python benchmarks/worker_overhead.py [--jobs 12] [--repeats 5] [--cpu 0]

Jobs of 64 requests x n=4 with 128-token prompts, logprobs on; the sim engine at infinite
speed (lognormal lengths median 300, p99 4000) answers at once, so what is timed is the
worker's own cost per job. Pinned to one core with one Arrow thread:

- ours, end to end: `pipeline.Client.submit` stages the jobs (not timed), then a real
  `RolloutWorker` in burst mode (no fork) takes each job: RQ's dequeue and bookkeeping,
  `workers.jobs.batch_job.prepare_batch` with its Redis reads of the staged prompts, the engine,
  `commit_batch` (contracts, Arrow table, Parquet shard written atomically, commit-log entry);
- of which the commit alone: `commit_batch` on the same outputs (the earlier figure);
- baseline, a plain pipeline doing the same work with the same tools as a competent user would
  write it: one RQ job per 64 requests (the request dicts as the job's arguments, JSON
  serializer), an `rq.SimpleWorker` in burst mode running a function that validates the
  requests, asks the same engine, builds the table column by column (the token and logprob
  columns from one concatenation of the samples' arrays and their offsets, no Python object per
  token), writes it with `pq.write_table` (zstd) and appends the shard to a Redis stream;
- the issue-24 baseline beside it: the same, but one dict per row and `pa.Table.from_pylist`.

Prints medians, the ratio, and the shard bytes per completion token of the token-id and
logprob columns (goal <= 5) and of the whole shard.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

import pipeline
from pipeline.core.broker.redis_server import RedisServer
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest
from workers.engines.base import SampleOutput
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.jobs import context
from workers.jobs.batch_job import PreparedBatch, commit_batch
from workers.process.worker import RolloutWorker

REQUESTS_PER_JOB = 64
N = 4
PROMPT = 128


class Replay(SimEngine):
    """An engine of truly infinite speed: the sim's outputs for these requests, computed once
    before the clock starts and handed back by request id (the sim's own sampling is not the
    worker's cost)."""

    def __init__(self, lines: list[dict]) -> None:
        super().__init__(SimConfig(median_tokens=300, p99_tokens=4000))
        requests = [RolloutRequest.model_validate(line) for line in lines]
        self.outputs = dict(zip([r.id for r in requests], super().submit(requests).result(), strict=True))

    def submit(self, requests: Sequence[RolloutRequest]) -> Future:
        future: Future = Future()
        future.set_result([self.outputs[r.id] for r in requests])
        return future

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        return [self.outputs[r.id] for r in requests]


def make_jobs(engine: SimEngine, lines: list[dict]) -> list[tuple[PreparedBatch, list[list[SampleOutput]]]]:
    out = []
    for j in range(0, len(lines), REQUESTS_PER_JOB):
        requests = [RolloutRequest.model_validate(line) for line in lines[j:j + REQUESTS_PER_JOB]]
        payload = JobPayload.pack(requests, run="bench", job_id=f"job-{j // REQUESTS_PER_JOB:04d}", batch_id="b",
                                  output="file:///unused", submitted_at_ms=int(time.time() * 1000))
        batch = PreparedBatch(payload, requests, engine, "bench-worker", 0, datetime.now(UTC))
        out.append((batch, engine.generate(requests)))
    return out


def ours(jobs: list, output: str, conn: redis.Redis) -> tuple[float, int]:
    tokens = 0
    start = time.perf_counter()
    for batch, outputs in jobs:
        batch.job = batch.job.model_copy(update={"output": output})
        tokens += commit_batch(batch, outputs, conn)["tokens"]
    return tokens / (time.perf_counter() - start), tokens


def request_lines(jobs: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"id": f"j{j}-q{i}", "input_ids": rng.integers(1, 150_000, PROMPT).tolist(),
             "sampling_params": {"n": N, "max_new_tokens": 100_000, "seed": j * 1000 + i}, "metadata": {"group": i}}
            for j in range(jobs) for i in range(REQUESTS_PER_JOB)]


def steady(finishes: list[tuple[float, int]]) -> float:
    """Tokens/s between the first job's commit and the last one's: whole job cycles (dequeue to
    commit) without the worker's start-up."""
    finishes = sorted(finishes)
    return sum(tokens for _, tokens in finishes[1:]) / (finishes[-1][0] - finishes[0][0])


def end_to_end(conn: redis.Redis, engine: SimEngine, lines: list[dict], output: str, run: str) -> tuple[float, float]:
    """A real worker in burst mode over jobs submitted as a user does: completion tokens/s from
    start to end, and steady (start-up left out)."""
    batch = pipeline.Client(conn).submit(lines, run=run, output=output, batch_size=REQUESTS_PER_JOB)
    start = time.perf_counter()
    RolloutWorker(conn, engine, feed=False).work(burst=True, with_scheduler=False, logging_level="WARNING")
    seconds = time.perf_counter() - start
    status = batch.wait(timeout=60)
    assert status.counts["finished"] == len(batch.job_ids), status.counts
    table = batch.read(columns=["job_id", "finished_at", "completion_tokens"]).to_pandas()
    per_job = table.groupby("job_id").agg(at=("finished_at", "max"), tokens=("completion_tokens", "sum"))
    finishes = [(at.timestamp(), int(tokens)) for at, tokens in zip(per_job["at"], per_job["tokens"], strict=True)]
    return sum(t for _, t in finishes) / seconds, steady(finishes)


_PLAIN_ENGINE: list[SimEngine] = []


def _plain_engine() -> SimEngine:
    """The baseline's engine: the same replay (the worker imports this script as a module of
    its own, so it is built there, from the same request lines, before its first job)."""
    if not _PLAIN_ENGINE:
        _PLAIN_ENGINE.append(Replay(request_lines(int(os.environ["WORKER_OVERHEAD_JOBS"]))))
    return _PLAIN_ENGINE[0]


def plain_job(requests: list[dict], run: str, job_id: str, directory: str) -> int:
    """The baseline's job function: validate, generate, one dict per row, pyarrow, a stream entry."""
    parsed = [RolloutRequest.model_validate(r) for r in requests]
    outputs = _plain_engine().generate(parsed)
    rows = []
    for request, samples in zip(parsed, outputs, strict=True):
        for index, sample in enumerate(samples):
            rows.append({
                "rollout_id": f"{request.id}:{index}", "request_id": request.id, "run": run, "job_id": job_id,
                "sample_index": index, "prompt_token_ids": request.input_ids,
                "completion_token_ids": sample.token_ids.tolist(),
                "completion_logprobs": sample.logprobs.tolist() if sample.logprobs is not None else None,
                "finish_reason": sample.finish.kind, "weight_version": sample.weight_version,
                "completion_tokens": len(sample.token_ids), "metadata": request.metadata,
            })
    path = Path(directory, f"{job_id}.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd")
    tokens = sum(r["completion_tokens"] for r in rows)
    from rq import get_current_job

    job = get_current_job()
    assert job is not None
    job.connection.xadd(f"plain:{run}:commits", {"job_id": job_id, "url": str(path), "tokens": tokens})
    return tokens


def _list_column(arrays: list[np.ndarray], dtype: pa.DataType) -> pa.ListArray:
    """One list column from per-row arrays: one concatenation and an offsets array."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.empty(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=dtype))


def plain_columnar_job(requests: list[dict], run: str, job_id: str, directory: str) -> int:
    """The columnar baseline's job function: validate, generate, the token columns built from
    concatenated arrays and offsets (no Python list per token), pyarrow, a stream entry."""
    parsed = [RolloutRequest.model_validate(r) for r in requests]
    outputs = _plain_engine().generate(parsed)
    pairs = [(request, index, sample) for request, samples in zip(parsed, outputs, strict=True)
             for index, sample in enumerate(samples)]
    prompts = {request.id: np.asarray(request.input_ids, dtype=np.int32) for request in parsed}
    lengths = np.array([len(sample.token_ids) for _, _, sample in pairs], dtype=np.int64)
    table = pa.table({
        "rollout_id": [f"{request.id}:{index}" for request, index, _ in pairs],
        "request_id": [request.id for request, _, _ in pairs],
        "run": pa.repeat(run, len(pairs)),
        "job_id": pa.repeat(job_id, len(pairs)),
        "sample_index": np.array([index for _, index, _ in pairs], dtype=np.int32),
        "prompt_token_ids": _list_column([prompts[request.id] for request, _, _ in pairs], pa.int32()),
        "completion_token_ids": _list_column([sample.token_ids for _, _, sample in pairs], pa.int32()),
        "completion_logprobs": _list_column([sample.logprobs for _, _, sample in pairs], pa.float32()),
        "finish_reason": [sample.finish.kind for _, _, sample in pairs],
        "weight_version": np.array([sample.weight_version for _, _, sample in pairs], dtype=np.int64),
        "completion_tokens": lengths,
        "metadata": [request.metadata for request, _, _ in pairs],
    })
    path = Path(directory, f"{job_id}.parquet")
    pq.write_table(table, path, compression="zstd")
    tokens = int(lengths.sum())
    from rq import get_current_job

    job = get_current_job()
    assert job is not None
    job.connection.xadd(f"plain:{run}:commits", {"job_id": job_id, "url": str(path), "tokens": tokens})
    return tokens


def plain_pipeline(conn: redis.Redis, lines: list[dict], directory: Path, run: str,
                   function: str = "plain_columnar_job") -> tuple[float, float]:
    """A baseline: plain RQ jobs of request dicts and a SimpleWorker running `function`;
    completion tokens/s from start to end, and steady."""
    directory.mkdir(parents=True)
    queue = Queue(f"plain-{run}", connection=conn, serializer=JSONSerializer)
    jobs = [queue.enqueue(f"worker_overhead.{function}", lines[i:i + REQUESTS_PER_JOB], run,
                          f"job-{i // REQUESTS_PER_JOB:04d}", str(directory))
            for i in range(0, len(lines), REQUESTS_PER_JOB)]
    _plain_engine()  # built before the clock starts
    start = time.perf_counter()
    SimpleWorker([queue], connection=conn, serializer=JSONSerializer).work(burst=True, logging_level="WARNING")
    seconds = time.perf_counter() - start
    results = [job.latest_result() for job in jobs]
    assert all(r is not None and r.type == r.Type.SUCCESSFUL for r in results), [r and r.exc_string for r in results]
    finishes = []
    for job, result in zip(jobs, results, strict=True):
        job.refresh()
        finishes.append((job.ended_at.timestamp(), int(result.return_value)))  # type: ignore[union-attr]
    return sum(t for _, t in finishes) / seconds, steady(finishes)


def footprint(directory: Path) -> tuple[float, float]:
    token_bytes = total_bytes = tokens = 0
    for path in directory.rglob("*.parquet"):
        meta = pq.ParquetFile(path).metadata
        total_bytes += path.stat().st_size
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                column = group.column(c)
                if column.path_in_schema.split(".")[0] in ("completion_token_ids", "completion_logprobs"):
                    token_bytes += column.total_compressed_size
        tokens += int(pq.read_table(path, columns=["completion_tokens"]).column(0).to_numpy().sum())
    return token_bytes / tokens, total_bytes / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=0)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    os.environ["WORKER_OVERHEAD_JOBS"] = str(args.jobs)
    lines = request_lines(args.jobs)
    engine = Replay(lines)
    context.install(context.WorkerContext(worker_id="bench-worker", engine=engine))
    jobs = make_jobs(engine, lines)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        commit_rates, ours_rates, base_rates, rows_rates = [], [], [], []
        for r in range(args.repeats):
            rate, tokens = ours(jobs, f"file://{tmp}/shards-{r}", conn)
            commit_rates.append(rate)
            ours_rates.append(end_to_end(conn, engine, lines, f"file://{tmp}/worker-{r}", f"e2e-{r}"))
            base_rates.append(plain_pipeline(conn, lines, Path(tmp) / f"plain-{r}", f"plain-{r}"))
            rows_rates.append(plain_pipeline(conn, lines, Path(tmp) / f"rows-{r}", f"rows-{r}", "plain_job"))
        per_token, per_token_all = footprint(Path(tmp) / "shards-0")
        plain_bytes = sum(p.stat().st_size for p in (Path(tmp) / "plain-0").iterdir()) / tokens
    def medians(rates: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(r for r, _ in rates), statistics.median(s for _, s in rates)

    (ours_all, ours_steady), (base_all, base_steady) = medians(ours_rates), medians(base_rates)
    rows_all, rows_steady = medians(rows_rates)

    def steady_range(rates: list[tuple[float, float]]) -> str:
        return f"min {min(s for _, s in rates) / 1e6:.2f}, max {max(s for _, s in rates) / 1e6:.2f}"

    print(f"worker overhead, end to end: {ours_steady / 1e6:.2f} M completion tokens/s steady, "
          f"{ours_all / 1e6:.2f} M with the worker's start-up (medians of {args.repeats}; dequeue, prompts from "
          f"Redis, infinite-speed engine, shard, commit, RQ bookkeeping; one core, logprobs; {args.jobs} jobs x "
          f"{REQUESTS_PER_JOB * N} rows, {tokens:,} tokens)")
    print(f"  of which the commit alone (commit_batch): {statistics.median(commit_rates) / 1e6:.2f} M tokens/s")
    print(f"  steady range over repeats: {steady_range(ours_rates)}")
    print(f"baseline plain RQ + columnar pyarrow pipeline: {base_steady / 1e6:.2f} M tokens/s steady "
          f"({steady_range(base_rates)}), {base_all / 1e6:.2f} M with start-up")
    print(f"ratio: {ours_steady / base_steady:.1f}x steady, {ours_all / base_all:.1f}x with start-up")
    print(f"earlier baseline, one dict per row + from_pylist: {rows_steady / 1e6:.2f} M tokens/s steady "
          f"({steady_range(rows_rates)}), {rows_all / 1e6:.2f} M with start-up; ratio {ours_steady / rows_steady:.1f}x "
          "steady")
    print(f"shard bytes per completion token: {per_token:.2f} (token ids + logprobs columns), "
          f"{per_token_all:.2f} (whole shard, prompts included); plain pipeline's shards: {plain_bytes:.2f}")


if __name__ == "__main__":
    main()
