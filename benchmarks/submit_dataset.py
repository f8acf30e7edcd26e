"""Dataset submit throughput: requests/s from a Parquet file of 512-token prompts into Redis, validated.

Ours: `pipeline.submit.enqueue.submit_dataset`, what `pipeline submit prompts.parquet` runs: record
batches of 8 192 rows read within the file's row groups, prompt ids range-checked per row on
the Arrow list column's values buffer, the other columns (id, seed, metadata) checked per row as
the strict model would, each job's ids copied once from the values buffer into its staged Redis
value. Baseline (same process, same Redis, same prompts and fields): the JSONL path,
`pipeline.submit.enqueue.submit_file`, on the same requests written as lines. Prints medians over
repeats and the ratio; then, in a fresh process, the submitter's peak RSS growth during a
dataset submit against the decoded size of the file's prompt ids.

    .venv/bin/python benchmarks/submit_dataset.py [--rows 100000] [--repeats 3] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis

from pipeline.core.broker.redis_server import RedisServer
from pipeline.submit.dataset_input import ColumnMapping, dataset_blocks
from pipeline.submit.dataset_source import open_path
from pipeline.submit.enqueue import submit_dataset, submit_file

MAPPING = ColumnMapping({"input_ids": "prompt_ids", "seed": "seed"}, {"group": "group"},
                        {"max_new_tokens": 512, "temperature": 1.0, "n": 4})


def make_files(directory: Path, rows: int, prompt_len: int) -> tuple[Path, Path]:
    """The same requests as Parquet (row groups of 16 384 rows) and as JSONL lines."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=rows * prompt_len, dtype=np.int32)
    offsets = np.arange(0, rows * prompt_len + 1, prompt_len, dtype=np.int32)
    table = pa.table({"prompt_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                      "seed": pa.array(np.arange(rows, dtype=np.int64)),
                      "group": pa.array(np.arange(rows, dtype=np.int64))})
    parquet = directory / "prompts.parquet"
    pq.write_table(table, parquet, row_group_size=16_384)
    jsonl = directory / "prompts.jsonl"
    with open(jsonl, "w") as handle:
        for i in range(rows):
            line = {"id": str(i), "input_ids": ids[i * prompt_len:(i + 1) * prompt_len].tolist(),
                    "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "n": 4, "seed": i},
                    "metadata": {"group": i}}
            handle.write(json.dumps(line) + "\n")
    return parquet, jsonl


def bench(conn: redis.Redis, submit: object, path: Path, batch_size: int, **kwargs: object) -> float:
    conn.flushall()
    start = time.perf_counter()
    plan = submit(conn, path, run="bench", output="memory://bench", batch_size=batch_size,  # type: ignore[operator]
                  **kwargs)
    return plan.requests / (time.perf_counter() - start)


def _status_bytes(field: str) -> int:
    """A `/proc/self/status` memory figure in bytes (VmRSS: now; VmHWM: the peak of this process image,
    unlike `ru_maxrss`, which a child inherits from its parent across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def validate_only(parquet: Path) -> float:
    """Rows/s read and validated by column, job fields built, nothing packed or sent to Redis."""
    start = time.perf_counter()
    rows = sum(len(block) for block in dataset_blocks(open_path(parquet), MAPPING))
    return rows / (time.perf_counter() - start)


def child_rss(url: str, parquet: str, batch_size: str) -> None:
    """In a fresh process: RSS before the submit (imports done) and peak RSS after, in bytes."""
    conn = redis.Redis.from_url(url)
    conn.flushall()
    before = _status_bytes("VmRSS")
    submit_dataset(conn, parquet, mapping=MAPPING, run="rss", output="memory://bench",
                   batch_size=int(batch_size))
    print(json.dumps({"before": before, "peak": _status_bytes("VmHWM")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="requests per job, both paths (default 64)")
    parser.add_argument("--child-rss", nargs=3, metavar=("URL", "PARQUET", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_rss:
        child_rss(*args.child_rss)
        return
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        conn = redis.Redis.from_url(server.url)
        parquet, jsonl = make_files(Path(tmp), args.rows, args.prompt_len)
        ours, base, checked = [], [], []
        for _ in range(args.repeats):  # interleaved, so the host's noise falls on both alike
            checked.append(validate_only(parquet))
            ours.append(bench(conn, submit_dataset, parquet, args.batch_size, mapping=MAPPING))
            base.append(bench(conn, submit_file, jsonl, args.batch_size))
        out = subprocess.run([sys.executable, __file__, "--child-rss", server.url, str(parquet),
                              str(args.batch_size)],
                             check=True, capture_output=True, text=True).stdout
        rss = json.loads(out.splitlines()[-1])
        decoded = pq.read_table(parquet, columns=["prompt_ids"]).column("prompt_ids").nbytes
        conn.flushall()
    ours_m, base_m = statistics.median(ours), statistics.median(base)
    print(f"dataset submit: {ours_m:,.0f} requests/s (median of {args.repeats}: "
          f"{', '.join(f'{x:,.0f}' for x in ours)}; {args.rows} x {args.prompt_len}-token prompts from Parquet, "
          f"validated, batch {args.batch_size})")
    print(f"baseline JSONL submit of the same requests: {base_m:,.0f} requests/s "
          f"({', '.join(f'{x:,.0f}' for x in base)})")
    print(f"ratio: {ours_m / base_m:.1f}x")
    print(f"of which read + validated by column (no packing, no Redis): {statistics.median(checked):,.0f} rows/s")
    growth = rss["peak"] - rss["before"]
    print(f"peak RSS growth of a dataset submit: {growth / 2**20:,.0f} MiB; decoded prompt ids "
          f"{decoded / 2**20:,.0f} MiB (Arrow, int32 + offsets): {growth / decoded:.2f}x")


if __name__ == "__main__":
    main()
