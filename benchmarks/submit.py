"""Submit throughput: requests/s from a JSONL of 512-token prompts into Redis, validated, with a
same-run regression check against a previous release.

Ours: `pipeline.submit.enqueue.submit_file`, what `pipeline submit` runs: lines parsed by simdjson in
blocks (prompt ids straight into arrays; the other fields checked as the strict model would,
each distinct sampling_params shape validated once by pydantic; anything unusual through the
full pydantic parse), each job packed as soon as it fills and its prompt ids (raw bytes beside
the job) staged to Redis from a background thread while parsing goes on, then one MULTI/EXEC
enqueuing every job.

Previous release (`--previous`, default a2dd44b): the same `submit_file` call on that commit's
tree, extracted with `git archive` from this clone (no network) and imported in its own process
with today's venv. This tree runs in a process of its own too, so both sides pay the same; the
two alternate, round by round, on the same Redis. The paired ratio per round is printed, and
the script exits 1 when its median is below `--min-ratio` (a regression).

Baselines (in this process, same Redis): what a competent user would write: each line validated
by pydantic (`RolloutRequest.model_validate_json`), 64 requests a job, jobs enqueued with
`Queue.enqueue_many` in one pipeline per 64 jobs; and the same with each job's prompt ids as one
int32 array under a key of its own, SET in the same pipeline (RQ zlib-compresses job data, which
is most of the first baseline's time with the ids inside). `--naive` adds the issue-9 baseline: one RQ
`Queue.enqueue` per request with the line as its JSON argument, unvalidated.

Beside the rates, the CPU seconds each tree's submit took (its process, every thread, by
`getrusage`; Redis's by `INFO cpu`), which other load on the machine disturbs less than the rate.

    .venv/bin/python benchmarks/submit.py [--requests 20000] [--repeats 5] [--naive]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from pipeline.core.broker.redis_server import RedisServer
from schemas.request import RolloutRequest

ROOT = Path(__file__).resolve().parents[1]
JOB_FUNCTION = "workers.jobs.batch_job.run_rollout_batch"
BATCH = 64

# Run in a process per tree: one `submit_file` per path read from stdin, its rate, Redis's
# used_memory, and the CPU seconds the submit took in its process (all threads) and in Redis
# (less sensitive to other load than the rate) printed as a JSON line. Imports what both releases have.
TIMER = """
import json, resource, sys, time
import redis
try:
    from pipeline.submit.enqueue import submit_file
except ImportError:  # releases before the package split
    from pipeline.submit import submit_file
conn = redis.Redis.from_url(sys.argv[1])

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    server = conn.info("cpu")
    return usage.ru_utime + usage.ru_stime, server["used_cpu_user"] + server["used_cpu_sys"]

for line in sys.stdin:
    conn.flushall()
    before = cpu()
    start = time.perf_counter()
    plan = submit_file(conn, line.strip(), run="bench", output="memory://bench", batch_size=64)
    rate = plan.requests / (time.perf_counter() - start)
    after = cpu()
    print(json.dumps({"rate": rate, "used_memory": conn.info("memory")["used_memory"], "cpu_s": after[0] - before[0],
                      "redis_cpu_s": after[1] - before[1]}), flush=True)
"""


def make_file(path: Path, count: int, prompt_len: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as handle:
        for i in range(count):
            line = {"id": f"q{i}", "input_ids": [rng.randrange(150_000) for _ in range(prompt_len)],
                    "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "n": 4, "seed": i},
                    "metadata": {"group": i}}
            handle.write(json.dumps(line) + "\n")


class Timer:
    """`submit_file` of one source tree, in its own process."""

    def __init__(self, tree: Path, redis_url: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", TIMER, redis_url], cwd=tree, text=True,
                                        env={**os.environ, "PYTHONPATH": str(tree)},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def submit(self, path: Path) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the timer process for {self.process.args} exited ({self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


@contextmanager
def release_tree(revision: str) -> Iterator[Path | None]:
    """`revision`'s files (from this clone's history, `git archive`), or None when the clone lacks it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        print(f"previous release {revision} is not in this clone ({archive.stderr.decode().strip()}): "
              "no regression check", file=sys.stderr)
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as tar_file:
        tar_file.write(archive.stdout)
        tar_file.seek(0)
        with tarfile.open(fileobj=tar_file) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


def bench_validated_batches(conn: redis.Redis, path: Path, *, ids_beside: bool) -> float:
    """A competent user's submit: pydantic per line, jobs of 64, enqueued 64 jobs a pipeline.
    `ids_beside`: each job's prompt ids as one int32 array under a key of their own (SET in the same
    pipeline) instead of JSON lists inside the job data, which RQ zlib-compresses."""
    conn.flushall()
    queue = Queue("baseline", connection=conn, serializer=JSONSerializer)
    start = time.perf_counter()
    count = 0
    chunk: list[dict] = []
    ids: list[list[int]] = []
    datas: list = []
    staged: dict[str, bytes] = {}

    def close_job() -> None:
        job_id = f"job-{len(datas)}-{count}"
        if ids_beside:
            staged[f"prompts:{job_id}"] = np.array([i for prompt in ids for i in prompt], dtype=np.int32).tobytes()
            ids.clear()
        datas.append(Queue.prepare_data(JOB_FUNCTION, args=(list(chunk),), job_id=job_id, description="x"))
        chunk.clear()

    def flush_jobs() -> None:
        with conn.pipeline() as pipe:
            if staged:
                pipe.mset(staged)
            queue.enqueue_many(datas, pipeline=pipe)
            pipe.execute()
        datas.clear()
        staged.clear()

    with open(path, "rb") as handle:
        for line in handle:
            request = RolloutRequest.model_validate_json(line)
            if ids_beside:
                ids.append(request.input_ids)
                chunk.append(request.model_dump(mode="json", exclude={"input_ids"}, exclude_defaults=True))
            else:
                chunk.append(request.model_dump(mode="json", exclude_defaults=True))
            count += 1
            if len(chunk) == BATCH:
                close_job()
                if len(datas) == BATCH:
                    flush_jobs()
    if chunk:
        close_job()
    if datas:
        flush_jobs()
    return count / (time.perf_counter() - start)


def bench_naive(conn: redis.Redis, path: Path) -> float:
    """The issue-9 baseline: one unvalidated `enqueue` per request."""
    conn.flushall()
    queue = Queue("baseline", connection=conn, serializer=JSONSerializer)
    start = time.perf_counter()
    count = 0
    with open(path) as handle:
        for line in handle:
            queue.enqueue(JOB_FUNCTION, json.loads(line), description="x")
            count += 1
    return count / (time.perf_counter() - start)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):,.0f}, min {min(values):,.0f}, max {max(values):,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--previous", default="a2dd44b", help="the release to check against (a git revision)")
    parser.add_argument("--min-ratio", type=float, default=0.95,
                        help="exit 1 when the median paired ratio to the previous release is below this")
    parser.add_argument("--naive", action="store_true", help="also time one unvalidated enqueue per request")
    args = parser.parse_args()
    with (tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server,
          release_tree(args.previous) as previous_tree):
        conn = redis.Redis.from_url(server.url)
        path = Path(tmp) / "rollouts.jsonl"
        make_file(path, args.requests, args.prompt_len)
        ours_timer = Timer(ROOT, server.url)
        previous_timer = Timer(previous_tree, server.url) if previous_tree else None
        timers = [ours_timer] + ([previous_timer] if previous_timer else [])
        for timer in timers:
            timer.submit(path)  # warm-up: imports, first-use caches
        ours, previous, validated, beside, naive, used = [], [], [], [], [], []
        cpus: dict[str, list[tuple[float, float]]] = {"ours": [], "previous": []}
        for _ in range(args.repeats):
            result = ours_timer.submit(path)
            ours.append(result["rate"])
            used.append(result["used_memory"])
            cpus["ours"].append((result["cpu_s"], result["redis_cpu_s"]))
            if previous_timer:
                result = previous_timer.submit(path)
                previous.append(result["rate"])
                cpus["previous"].append((result["cpu_s"], result["redis_cpu_s"]))
            validated.append(bench_validated_batches(conn, path, ids_beside=False))
            beside.append(bench_validated_batches(conn, path, ids_beside=True))
            if args.naive:
                naive.append(bench_naive(conn, path))
        for timer in timers:
            timer.close()
    tokens = args.requests * args.prompt_len
    print(f"submit ({args.requests} x {args.prompt_len}-token prompts, n=4, validated, batch 64, {args.repeats} "
          f"rounds): {spread(ours)} requests/s")
    print(f"baseline, pydantic per line + jobs of 64 enqueued in pipelines: {spread(validated)} requests/s; "
          f"ratio {statistics.median(ours) / statistics.median(validated):.2f}x")
    print(f"baseline, the same with each job's prompt ids as an int32 array beside it (no zlib): {spread(beside)} "
          f"requests/s; ratio {statistics.median(ours) / statistics.median(beside):.2f}x")
    if naive:
        print(f"baseline, one unvalidated enqueue per request: {spread(naive)} requests/s; "
              f"ratio {statistics.median(ours) / statistics.median(naive):.1f}x")
    print(f"Redis memory per queued prompt token: {statistics.median(used) / tokens:.2f} bytes "
          "(used_memory after submit / tokens)")
    if not previous:
        return
    paired = [o / p for o, p in zip(ours, previous, strict=True)]
    ratio = statistics.median(paired)
    print(f"previous release {args.previous}: {spread(previous)} requests/s")
    print(f"this tree / {args.previous}: {ratio:.3f} (median of {len(paired)} paired rounds; min {min(paired):.3f}, "
          f"max {max(paired):.3f})")
    for name, index in (("submitting process", 0), ("Redis", 1)):
        mine, theirs = ([c[index] for c in cpus[side]] for side in ("ours", "previous"))
        cpu_paired = [m / t for m, t in zip(mine, theirs, strict=True)]
        print(f"CPU seconds a submit, {name}: this tree {statistics.median(mine):.3f} (min {min(mine):.3f}, max "
              f"{max(mine):.3f}), {args.previous} {statistics.median(theirs):.3f} (min {min(theirs):.3f}, max "
              f"{max(theirs):.3f}); paired ratio median {statistics.median(cpu_paired):.3f}")
    if ratio < args.min_ratio:
        print(f"REGRESSION: submit is at {ratio:.3f} of {args.previous}'s speed (--min-ratio {args.min_ratio})")
        sys.exit(1)


if __name__ == "__main__":
    main()
