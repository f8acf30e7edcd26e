"""Sampling defaults for a JSONL file (`pipeline submit FILE.jsonl --temperature T --n N`): their parse cost.

- ours: the lines without sampling parameters, validated with the defaults hook
  (`pipeline.submit.request_file.with_sampling_defaults`, what `submit_file(sampling=...)` uses);
- baseline (what a user did before the flags took JSONL): rewrite every line with `json` to add
  the same `sampling_params`, then validate the rewritten lines (the parser's fast path);
- reference, not a baseline: validating lines that already carry the parameters (the file
  written with them in the first place).

Validation only (no Redis): each figure is the median of `--repeats` runs over `--lines` lines
of `--prompt-tokens` ids, with the min-max spread.

    .venv/bin/python benchmarks/sampling_defaults.py [--lines 20000] [--prompt-tokens 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from pipeline.submit.request_file import parse_request_lines, with_sampling_defaults

DEFAULTS = {"temperature": 0.7, "n": 4, "max_new_tokens": 256}


def timed(run: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), min(seconds), max(seconds)


def rewrite_then_parse(lines: list[bytes]) -> object:
    rewritten = []
    for raw in lines:
        line = json.loads(raw)
        line["sampling_params"] = {**DEFAULTS, **line.get("sampling_params", {})}
        rewritten.append(json.dumps(line).encode())
    return parse_request_lines(rewritten)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ids = list(range(1000, 1000 + args.prompt_tokens))
    plain = [json.dumps({"id": f"q{i}", "input_ids": ids}).encode() for i in range(args.lines)]
    written = [json.dumps({"id": f"q{i}", "input_ids": ids, "sampling_params": DEFAULTS}).encode()
               for i in range(args.lines)]
    hook = with_sampling_defaults(DEFAULTS)
    ours = timed(lambda: parse_request_lines(plain, renderer=hook), args.repeats)
    baseline = timed(lambda: rewrite_then_parse(plain), args.repeats)
    reference = timed(lambda: parse_request_lines(written), args.repeats)
    for name, (median, low, high) in [("ours: defaults hook", ours), ("baseline: rewrite with json, then parse",
                                                                       baseline),
                                      ("reference: lines written with them", reference)]:
        print(f"{name:<42} {median:7.3f} s  (min {low:.3f}, max {high:.3f})  {args.lines / median:9.0f} lines/s")
    print(f"ours / baseline: {ours[0] / baseline[0]:.2f}x the time; ours / reference: {ours[0] / reference[0]:.2f}x")


if __name__ == "__main__":
    main()
