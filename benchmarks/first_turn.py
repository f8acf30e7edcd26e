"""A fresh stack's first agent turn against the turns after it.

Each round starts what a user starts: the embedded Redis (`pipeline redis start`, a fresh HOME), one
`pipeline worker --engine sim --sim-step-ms 0` (the sim at infinite speed: **the sim's figures**)
and `pipeline serve`, waits until the server counts the worker, then makes `--turns` calls one after
another (`POST /v1/completions`, 8 tokens, through one httpx client); the baseline is the same
round's later turns. Prints each round's first turn and the median of its later ones, then the
medians over rounds and first / later.

    .venv/bin/python benchmarks/first_turn.py [--rounds 5 --turns 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import free_port, wait_for_serve

PIPELINE = [sys.executable, "-m", "pipeline.cli.main"]
BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8}


def one_round(turns: int) -> list[float]:
    """Seconds of each of `turns` calls to a stack started for this round."""
    with tempfile.TemporaryDirectory(prefix="first-turn-") as home:
        env = {**os.environ, "HOME": home, "PIPELINE_POOL": "first-turn"}
        env.pop("PIPELINE_REDIS_URL", None)
        subprocess.run([*PIPELINE, "redis", "start"], env=env, check=True, capture_output=True)
        port = free_port()
        procs = [subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", "--sim-step-ms", "0"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                 subprocess.Popen([*PIPELINE, "serve", "--port", str(port), "--run", "first-turn"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_serve(url, 1)
            seconds = []
            with httpx.Client(timeout=60) as client:
                client.get(f"{url}/health")  # the connection up: the turns time the server and worker only
                for _ in range(turns):
                    started = time.perf_counter()
                    client.post(f"{url}/v1/completions", json=BODY).raise_for_status()
                    seconds.append(time.perf_counter() - started)
            return seconds
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
            subprocess.run([*PIPELINE, "redis", "stop"], env=env, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=5, help="calls a round (the first, then its baseline)")
    args = ap.parse_args()
    firsts, laters = [], []
    for r in range(args.rounds):
        seconds = one_round(args.turns)
        firsts.append(seconds[0])
        laters.append(statistics.median(seconds[1:]))
        print(f"round {r}: first turn {seconds[0] * 1000:.1f} ms, later turns {laters[-1] * 1000:.1f} ms (median)")
    first, later = statistics.median(firsts), statistics.median(laters)
    print(f"first turn {first * 1000:.1f} ms (min {min(firsts) * 1000:.1f}, max {max(firsts) * 1000:.1f}); "
          f"later turns {later * 1000:.1f} ms (min {min(laters) * 1000:.1f}, max {max(laters) * 1000:.1f}); "
          f"first / later {first / later:.2f}x (the sim's figures, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
