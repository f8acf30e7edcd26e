"""Stored size and read throughput of the routed-experts column (48 layers x top-8 x 128 experts).

    .venv/bin/python benchmarks/routed_experts.py [--rows 32] [--tokens 1024] [--repeats 5]
                                                  [--scenario realistic|zipf|uniform|all]

Writes one shard as a worker does (`workers.rows.table.build_table`, which stores each (position,
layer)'s top-k ids ascending through `canonical_routed_experts`, then `write_shard`) whose rows
carry synthetic routings `[tokens - 1, 48, 8]`, and prints:

- bytes stored per (token, layer, k) — the column chunk's compressed size over the number of
  ids — against raw int32 (4 bytes, SGLang's wire format), against the same rows with the ids
  left in score order (the generators' order, before canonicalisation; same writer options)
  and against pyarrow's defaults (dictionary encoding + zstd) on the stored rows, all written
  in the same process. Goal: <= 0.5, i.e. <= 1/8 of int32;
  Ascending ids change little under zstd: it codes literals order-0, and the marginal of the
  ids is the same in either order; sorting helps a coder that models each id given the one
  before (measured once: brotli 5 on this column, 0.511 bytes realistic, but reads ~3x slower);
- read throughput of the column (Parquet decode of the column alone, then to numpy arrays with
  `pipeline.routed_experts`), medians of several repeats, in ids/s and tokens/s.

Routing scenarios (seeded, per layer):
- `uniform`: every expert equally likely, no correlation. Information-theoretic floor:
  log2(128 * 127 * ... * 121) / 8 = 6.97 bits = 0.87 bytes per id for ordered top-8, and
  log2(C(128, 8)) / 8 = 5.06 bits = 0.63 bytes per id for the set the shard stores — no
  lossless coder can reach 0.5 here; it is the worst case.
- `zipf`: expert popularity Zipf(s=1.0) under a per-layer permutation (hot experts differ by
  layer), top-8 drawn without replacement in score order, no correlation between tokens.
- `realistic`: `zipf` plus what real MoE routers show: token-identity specialisation (each
  token of a Zipf(1.2) vocabulary of 4096 has a preferred routing per layer, followed with
  probability 0.7 in the first layer falling to 0.2 in the last) and temporal correlation
  (otherwise, with probability 0.3 a position keeps the previous position's routing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import pipeline
from pipeline.core.routed_experts import ROUTED_EXPERTS_COLUMNS
from schemas.request import RolloutRequest
from workers.engines.base import Finish, SampleOutput
from workers.rows.shard_writer import COMPRESSION, encode, write_shard
from workers.rows.table import RowContext, build_table

LAYERS, TOP_K, EXPERTS = 48, 8, 128
SCENARIOS = ("realistic", "zipf", "uniform")


def _top_k(rng: np.random.Generator, log_popularity: np.ndarray, count: int) -> np.ndarray:
    """`count` draws of top-8 without replacement (Gumbel top-k), best score first."""
    scores = log_popularity[None, :] + rng.gumbel(size=(count, EXPERTS))
    part = np.argpartition(-scores, TOP_K, axis=1)[:, :TOP_K]
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1).astype(np.uint8)


def synthetic_routing(rng: np.random.Generator, tokens: int, scenario: str) -> np.ndarray:
    """`[tokens, 48, 8]` uint8 expert ids for one sequence."""
    out = np.empty((tokens, LAYERS, TOP_K), dtype=np.uint8)
    s = 0.0 if scenario == "uniform" else 1.0
    vocab = 4096
    words = (rng.zipf(1.2, tokens) - 1) % vocab
    for layer in range(LAYERS):
        perm = rng.permutation(EXPERTS)
        log_pop = -s * np.log(np.arange(1, EXPERTS + 1, dtype=np.float64))[np.argsort(perm)]
        fresh = _top_k(rng, log_pop, tokens)
        if scenario == "realistic":
            home = _top_k(np.random.default_rng([layer, 17]), log_pop, vocab)  # per-layer, fixed per word
            follow = 0.7 + (0.2 - 0.7) * layer / (LAYERS - 1)
            use_home = rng.random(tokens) < follow
            keep = ~use_home & (rng.random(tokens) < 0.3)
            keep[0] = False
            fresh = np.where(use_home[:, None], home[words], fresh)
            source = np.where(keep, 0, np.arange(tokens))  # carry the previous routing forward
            source = np.maximum.accumulate(source)
            fresh = fresh[source]
        out[:, layer] = fresh
    return out


def shard_table(rng: np.random.Generator, rows: int, tokens: int, scenario: str) -> tuple[pa.Table, pa.Table]:
    """A job's rows as the worker builds them (prompt 64 tokens, completion `tokens - 64`), and the
    same rows with the routed experts in score order, as the engine reported them."""
    prompt = 64
    requests, outputs = [], []
    for i in range(rows):
        completion = tokens - prompt
        requests.append(RolloutRequest(
            id=f"q{i}", input_ids=list(range(1, prompt + 1)), return_routed_experts=True, logprobs=None,
            sampling_params={"max_new_tokens": completion},
        ))
        sample = SampleOutput(
            token_ids=rng.integers(1, 1000, completion, dtype=np.int32), finish=Finish("length"),
            routed_experts=synthetic_routing(rng, prompt + completion - 1, scenario),
        )
        outputs.append([sample])
    now = datetime.now(UTC)
    ctx = RowContext(run="bench", job_id="job-0", engine="sim", model="bench", worker_id="w", weight_version=0,
                     submitted_at=now, started_at=now, finished_at=now, num_experts=EXPERTS)
    table = build_table(requests, outputs, ctx)
    column = table.schema.get_field_index("routed_experts")
    score_ordered = pa.array([o[0].routed_experts.reshape(-1) for o in outputs], type=table.schema.field(column).type)
    return table, table.set_column(column, table.schema.field(column), score_ordered)


def column_bytes(path: str, column: str = "routed_experts") -> int:
    meta = pq.ParquetFile(path).metadata
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            if group.column(c).path_in_schema.split(".")[0] == column:
                total += group.column(c).total_compressed_size
    return total


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(scenario: str, rows: int, tokens: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    table, score_ordered = shard_table(rng, rows, tokens, scenario)
    ids = sum(int(np.prod(s)) for s in table.column("routed_experts_shape").to_pylist())
    positions = ids // (LAYERS * TOP_K)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        url = write_shard(table, f"file://{tmp}", "bench", "job-0")
        write_s = time.perf_counter() - start
        path = url.removeprefix("file://")
        ours = column_bytes(path)
        default_path = f"{tmp}/default.parquet"
        pq.write_table(table, default_path, compression=COMPRESSION)
        default = column_bytes(default_path)
        ordered_path = f"{tmp}/score_ordered.parquet"
        with open(ordered_path, "wb") as f:
            f.write(encode(score_ordered))  # the worker's writer options, ids not canonicalised
        ordered = column_bytes(ordered_path)
        per_id = ours / ids
        print(f"[{scenario}] {rows} rows, {positions} positions, {ids / 1e6:.1f}M ids; shard written in {write_s:.2f}s")
        print(f"  stored: {per_id:.3f} bytes per (token, layer, k) = {per_id * LAYERS * TOP_K:.0f} bytes per token; "
              f"raw int32 {4 * ids / ours:.1f}x larger (ratio {per_id / 4:.3f}, goal <= 0.125); "
              f"pyarrow defaults (dictionary+zstd) {default / ids:.3f} bytes ({default / ours:.2f}x ours)")
        print(f"  baseline, score-ordered (before canonicalisation): {ordered / ids:.3f} bytes per (token, layer, k) "
              f"(ratio {ordered / ids / 4:.3f} of raw int32; ascending sets save {1 - ours / ordered:.1%})")
        other = pq.read_table(path, columns=["completion_token_ids"])  # projection: not this column
        assert other.num_columns == 1
        decode_s = median_time(lambda: pq.read_table(path, columns=ROUTED_EXPERTS_COLUMNS), repeats)
        read = pq.read_table(path, columns=ROUTED_EXPERTS_COLUMNS)
        numpy_s = median_time(lambda: pipeline.routed_experts(read), repeats)
        slice_s = median_time(lambda: pipeline.routed_experts(read, layers=slice(0, 12)), repeats)
        default_decode_s = median_time(
            lambda: pq.read_table(default_path, columns=ROUTED_EXPERTS_COLUMNS), repeats)
        print(f"  read (median of {repeats}): Parquet decode {ids / decode_s / 1e6:.0f}M ids/s "
              f"({positions / decode_s / 1e6:.2f}M tokens/s, {decode_s * 1e3:.1f} ms); "
              f"pyarrow-defaults file {ids / default_decode_s / 1e6:.0f}M ids/s; "
              f"to numpy arrays {ids / numpy_s / 1e6:.0f}M ids/s; layers 0-11 only {ids / slice_s / 1e6:.0f}M ids/s")
        check = pipeline.routed_experts(read)
        assert check[0].shape == (tokens - 1, LAYERS, TOP_K)  # type: ignore[index]
        assert all((np.diff(a.astype(np.int16), axis=-1) > 0).all() for a in check)  # type: ignore[union-attr]
    return per_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt + completion tokens per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    args = parser.parse_args()
    for scenario in SCENARIOS if args.scenario == "all" else (args.scenario,):
        run(scenario, args.rows, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
