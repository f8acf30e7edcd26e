"""What keeping request ids unique in a run costs a submit (issue 36).

`submit_file` adds every request id to the run's id set (`keys.run_request_ids`) in its enqueue
transaction and, when the run has ids already, checks the new ones against them first
(`pipeline.submit.run_ids`: a Lua script each, the ids as one JSON array). Measured: the same
`submit_file` of a JSONL of 512-token prompts, in this process on one Redis, with the id set
(this tree) and with it patched out (the submit as before issue 36: the baseline), alternating
round by round; a first submit into a fresh run, and a second submit of new ids into a run that
holds as many already (the check's path). Medians with min and max. On a loaded machine the
paired ratios scatter widely, so the id set's own work (encoding, WATCH, check and add of one
submit, timed alone) is printed beside them as a share of a submit.

    .venv/bin/python benchmarks/submit_run_ids.py [--requests 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

import pipeline.submit.enqueue as submit
from pipeline.core.broker import keys
from pipeline.core.broker.redis_server import RedisServer
from pipeline.submit import run_ids


def make_file(path: Path, count: int, prefix: str) -> None:
    rng = random.Random(0)
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(json.dumps({"id": f"{prefix}{i}", "input_ids": [rng.randrange(150_000) for _ in range(512)],
                                     "sampling_params": {"max_new_tokens": 512, "n": 4, "seed": i}}) + "\n")


@contextmanager
def without_id_set() -> Iterator[None]:
    """The submit without the run's id set: no check, nothing added (as before issue 36)."""
    encode, check, add = run_ids.encode, run_ids.refuse_taken, run_ids.add
    run_ids.encode = lambda ids: ""  # type: ignore[assignment]
    run_ids.refuse_taken = run_ids.add = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        run_ids.encode, run_ids.refuse_taken, run_ids.add = encode, check, add


def timed(conn: redis.Redis, path: Path, run: str) -> float:
    start = time.perf_counter()
    submit.submit_file(conn, str(path), run=run, output="memory://bench", batch_size=64)
    return time.perf_counter() - start


def id_set_work(conn: redis.Redis, ids: list[str], existing: list[str]) -> float:
    """Seconds of the id set's work in one submit: encoding, WATCH, the check, the add in a MULTI/EXEC."""
    conn.flushall()
    if existing:
        conn.sadd(keys.run_request_ids("r"), *existing)
    start = time.perf_counter()
    with conn.pipeline(transaction=True) as pipe:
        encoded = run_ids.encode(ids)
        run_ids.refuse_taken(pipe, "r", encoded)
        pipe.multi()
        run_ids.add(pipe, "r", encoded)
        pipe.execute()
    return time.perf_counter() - start


def summary(name: str, seconds: list[float], requests: int) -> str:
    rates = sorted(requests / s for s in seconds)
    return f"{name}: median {statistics.median(rates):,.0f}, min {rates[0]:,.0f}, max {rates[-1]:,.0f} requests/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis", port=0) as server:
        first, second = Path(tmp) / "first.jsonl", Path(tmp) / "second.jsonl"
        make_file(first, args.requests, "a")
        make_file(second, args.requests, "b")
        conn = server.client()
        times: dict[str, list[float]] = {key: [] for key in ("ours-first", "base-first", "ours-second",
                                                             "base-second")}
        ratios: dict[str, list[float]] = {"first": [], "second": []}
        for round_ in range(args.repeats):
            for label in ("ours", "base") if round_ % 2 == 0 else ("base", "ours"):
                conn.flushall()
                if label == "ours":
                    times["ours-first"].append(timed(conn, first, "r"))
                    times["ours-second"].append(timed(conn, second, "r"))
                else:
                    with without_id_set():
                        times["base-first"].append(timed(conn, first, "r"))
                        times["base-second"].append(timed(conn, second, "r"))
            for case in ratios:
                ratios[case].append(times[f"base-{case}"][-1] / times[f"ours-{case}"][-1])
        print(f"submit_file of {args.requests} x 512-token prompts (n=4, batch 64), {args.repeats} rounds, one Redis")
        for case, words in (("first", "a fresh run"), ("second", f"a run holding {args.requests} ids")):
            print(summary(f"  into {words}, ids kept unique (this tree)", times[f"ours-{case}"], args.requests))
            print(summary(f"  into {words}, baseline without the id set", times[f"base-{case}"], args.requests))
            paired = sorted(ratios[case])
            print(f"  ratio this tree / baseline: median {statistics.median(paired):.3f} "
                  f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, paired rounds)")
        for case, existing in (("first", []), ("second", [f"a{i}" for i in range(args.requests)])):
            work = sorted(id_set_work(conn, [f"b{i}" for i in range(args.requests)], existing)
                          for _ in range(args.repeats))
            share = statistics.median(work) / statistics.median(times[f"ours-{case}"])
            print(f"  the id set's own work, {case} submit: median {statistics.median(work) * 1000:.1f} ms "
                  f"(min {work[0] * 1000:.1f}, max {work[-1] * 1000:.1f}), {share:.1%} of the submit's median time")
        conn.flushall()
        before = conn.info("memory")["used_memory"]
        timed(conn, first, "r")
        ids = conn.memory_usage(keys.run_request_ids("r"), samples=0) or 0
        print(f"  the run's id set: {ids / args.requests:.1f} bytes per request "
              f"({ids / (conn.info('memory')['used_memory'] - before):.1%} of what the submit added to Redis)")


if __name__ == "__main__":
    main()
