"""Worker overhead: engine output -> committed shard, completion tokens/s on one core; shard footprint.

    .venv/bin/python benchmarks/worker_overhead.py [--jobs 12] [--repeats 5] [--cpu 0]

Outputs come from the sim engine at infinite speed (lognormal lengths median 300, p99 4000;
jobs of 64 requests x n=4 with 128-token prompts; logprobs on), generated before the clock
starts. Pinned to one core with one Arrow thread, the timed part is what the worker does per
job after the engine: the contracts and Arrow table (`workers.rows.build_table`), the Parquet
shard written atomically to a local directory (`workers.shard_writer.write_shard`) and the
commit-log entry in Redis (`pipeline.commit_log.append`), i.e. `workers.batch_job.commit_batch`.

Baseline, same process, same outputs: the same rows written as JSON lines (one `json.dumps`
per row) to one file per job. Prints medians, the ratio, and the shard bytes per completion
token of the token-id and logprob columns (goal <= 5) and of the whole shard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis

from pipeline.redis_server import RedisServer
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest
from workers import context
from workers.batch_job import PreparedBatch, commit_batch
from workers.engines.base import SampleOutput
from workers.engines.sim import SimConfig, SimEngine

REQUESTS_PER_JOB = 64
N = 4
PROMPT = 128


def make_jobs(engine: SimEngine, jobs: int) -> list[tuple[PreparedBatch, list[list[SampleOutput]]]]:
    rng = np.random.default_rng(0)
    out = []
    for j in range(jobs):
        requests = [RolloutRequest(id=f"j{j}-q{i}", input_ids=rng.integers(1, 150_000, PROMPT).tolist(),
                                   sampling_params={"n": N, "max_new_tokens": 100_000, "seed": j * 1000 + i},
                                   metadata={"group": i})
                    for i in range(REQUESTS_PER_JOB)]
        payload = JobPayload.pack(requests, run="bench", job_id=f"job-{j:04d}", batch_id="b", output="file:///unused",
                                  submitted_at_ms=int(time.time() * 1000))
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


def baseline(jobs: list, directory: Path) -> float:
    tokens = 0
    start = time.perf_counter()
    for batch, outputs in jobs:
        with open(directory / f"{batch.job.job_id}.jsonl", "w") as handle:
            for request, samples in zip(batch.requests, outputs, strict=True):
                for index, sample in enumerate(samples):
                    ids = sample.token_ids.tolist()
                    tokens += len(ids)
                    handle.write(json.dumps({
                        "rollout_id": f"{request.id}:{index}", "request_id": request.id, "run": batch.job.run,
                        "job_id": batch.job.job_id, "prompt_token_ids": request.input_ids,
                        "completion_token_ids": ids, "completion_logprobs": sample.logprobs.tolist(),
                        "finish_reason": sample.finish.kind, "weight_version": 0,
                        "metadata": request.metadata,
                    }) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    return tokens / (time.perf_counter() - start)


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
    engine = SimEngine(SimConfig(median_tokens=300, p99_tokens=4000))
    context.install(context.WorkerContext(worker_id="bench-worker", engine=engine))
    jobs = make_jobs(engine, args.jobs)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        rates = []
        for r in range(args.repeats):
            rate, tokens = ours(jobs, f"file://{tmp}/shards-{r}", conn)
            rates.append(rate)
        per_token, per_token_all = footprint(Path(tmp) / "shards-0")
        (Path(tmp) / "json").mkdir()
        base = [baseline(jobs, Path(tmp) / "json") for _ in range(args.repeats)]
        json_bytes = sum(p.stat().st_size for p in (Path(tmp) / "json").iterdir()) / tokens
    ours_m, base_m = statistics.median(rates), statistics.median(base)
    print(f"worker overhead: {ours_m / 1e6:.2f} M completion tokens/s (median of {args.repeats}; engine output -> "
          f"committed Parquet shard, one core, logprobs; {args.jobs} jobs x {REQUESTS_PER_JOB * N} rows, "
          f"{tokens:,} tokens)")
    print(f"baseline JSON lines: {base_m / 1e6:.2f} M tokens/s")
    print(f"ratio: {ours_m / base_m:.1f}x")
    print(f"shard bytes per completion token: {per_token:.2f} (token ids + logprobs columns), "
          f"{per_token_all:.2f} (whole shard, prompts included); JSON lines: {json_bytes:.1f}")


if __name__ == "__main__":
    main()
