"""Tokens/s from Parquet shards to padded torch tensors, against `datasets` read vectorised.

    .venv/bin/python benchmarks/read_to_torch.py [--tokens 1048576] [--completion 512] [--p99 4096]
                                                 [--lengths lognormal] [--prompt 64] [--repeats 7] [--cpu 0]

Writes shards as workers do (`workers.rows.shard_writer.write_shard`, full shard schema, jobs of
64 requests x n=4) with completion lengths drawn lognormal (median `--completion`, p99
`--p99`, as RL rollouts are: batches are padded to their longest row) or all equal
(`--lengths fixed`), then, pinned to one core with one thread everywhere, times:

- ours: `RolloutBatches` (group-aware, padded) reading the shards from disk, decoding
  Parquet and building `input_ids`, `attention_mask`, `loss_mask`, `old_logprobs`;
- baseline: `datasets.load_dataset("parquet", ...)` (its one-time Arrow cache build timed
  apart) read the fast way: `with_format("numpy")`, batches of the same size from
  `Dataset.iter`, padding vectorised (lengths, a boolean mask, one masked assignment per
  column, `torch.from_numpy`);
- and, as the earlier baseline, the same dataset row by row with a per-row collate
  (`torch.tensor` per row, `pad_sequence`).

Prints the medians (and best) of several repeats, tokens/s (completion tokens, and with the
prompts), and the ratios. Goal: >= 50M tokens/s on one core and >= 5x the datasets path. A last
line reads the same rows from shards written without dictionary encoding on the numeric list
columns, to size that writer setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.nn.utils.rnn import pad_sequence

from pipeline.read.torch_data import GROUP_COLUMN, TENSOR_COLUMNS, RolloutBatches
from schemas.shard import SHARD_SCHEMA
from workers.rows.shard_writer import COMPRESSION, write_shard

RUN = "bench"
Z99 = 2.3263478740408408  # the standard normal quantile of 0.99
REQUESTS_PER_JOB = 64
N = 4


def list_column(rng: np.random.Generator, lengths: np.ndarray, dtype: type) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    if dtype is np.float32:
        values = pa.array(-rng.exponential(1.0, total).astype(np.float32))
    else:
        values = pa.array(rng.integers(0, 151_000, total, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, values)


def completion_lengths(rng: np.random.Generator, rows: int, median: int, p99: int, kind: str) -> np.ndarray:
    if kind == "fixed":
        return np.full(rows, median, dtype=np.int64)
    sigma = np.log(p99 / median) / Z99
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, rows)), 1, p99 * 4).astype(np.int64)


def job_table(rng: np.random.Generator, job: int, prompt: int, lengths: np.ndarray) -> pa.Table:
    rows = REQUESTS_PER_JOB * N
    now = pa.scalar(datetime.now(UTC), pa.timestamp("ms", tz="UTC"))
    request_ids = [f"j{job}-q{i // N}" for i in range(rows)]
    columns: dict[str, pa.Array] = {
        "rollout_id": pa.array([f"{r}:{i % N}" for i, r in enumerate(request_ids)]),
        "request_id": pa.array(request_ids),
        "run": pa.array([RUN] * rows),
        "job_id": pa.array([f"job-{job}"] * rows),
        "sample_index": pa.array(np.arange(rows, dtype=np.int32) % N),
        "prompt_token_ids": list_column(rng, np.full(rows, prompt), np.int32),
        "completion_token_ids": list_column(rng, lengths, np.int32),
        "completion_logprobs": list_column(rng, lengths, np.float32),
        "finish_reason": pa.array(["length"] * rows),
        "weight_version": pa.array(np.full(rows, 7, dtype=np.int64)),
        "temperature": pa.array(np.ones(rows, np.float32)),
        "top_p": pa.array(np.ones(rows, np.float32)),
        "top_k": pa.array(np.full(rows, -1, np.int32)),
        "min_p": pa.array(np.zeros(rows, np.float32)),
        "max_new_tokens": pa.array(np.full(rows, int(lengths.max()), np.int32)),
        "prompt_tokens": pa.array(np.full(rows, prompt, np.int32)),
        "completion_tokens": pa.array(lengths.astype(np.int32)),
        "cached_tokens": pa.array(np.zeros(rows, np.int32)),
        "engine": pa.array(["sim"] * rows),
        "model": pa.array(["bench"] * rows),
        "worker_id": pa.array(["w0"] * rows),
        "submitted_at": pa.array([now] * rows, pa.timestamp("ms", tz="UTC")),
        "started_at": pa.array([now] * rows, pa.timestamp("ms", tz="UTC")),
        "finished_at": pa.array([now] * rows, pa.timestamp("ms", tz="UTC")),
        "metadata": pa.array(["{}"] * rows),
    }
    arrays = [
        columns[f.name] if f.name in columns else pa.nulls(rows, f.type) for f in SHARD_SCHEMA
    ]
    return pa.Table.from_arrays(arrays, schema=SHARD_SCHEMA)


def write_shards(output: str, tokens: int, prompt: int, completion: int, p99: int, kind: str) -> tuple[int, int]:
    """Shards holding at least `tokens` completion tokens; returns (completion, all) tokens."""
    rng = np.random.default_rng(0)
    completion_total = rows_total = 0
    job = 0
    while completion_total < tokens:
        lengths = completion_lengths(rng, REQUESTS_PER_JOB * N, completion, p99, kind)
        write_shard(job_table(rng, job, prompt, lengths), output, RUN, f"job-{job}")
        completion_total += int(lengths.sum())
        rows_total += len(lengths)
        job += 1
    return completion_total, completion_total + rows_total * prompt


def ours(output: str, batch_size: int) -> int:
    dataset = RolloutBatches(output, run=RUN, batch_size=batch_size, pad_id=0, use_threads=False)
    return sum(int(batch["loss_mask"].count_nonzero()) for batch in dataset)


def decode_only(files: list[str]) -> int:
    """Just the Parquet decode of the columns the collate needs (the floor of `ours`)."""
    columns = [*TENSOR_COLUMNS, GROUP_COLUMN]
    return sum(
        pq.ParquetFile(f, memory_map=True, read_dictionary=[GROUP_COLUMN]).read(columns=columns, use_threads=False)
        .num_rows for f in files
    )


def naive_collate(rows: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    ids, masks, lps = [], [], []
    for row in rows:
        prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
        ids.append(torch.tensor(prompt + completion, dtype=torch.long))
        masks.append(torch.tensor([0] * len(prompt) + [1] * len(completion), dtype=torch.bool))
        lps.append(torch.tensor([0.0] * len(prompt) + row["completion_logprobs"], dtype=torch.float32))
    input_ids = pad_sequence(ids, batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(t) for t in ids])
    return {
        "input_ids": input_ids,
        "attention_mask": (torch.arange(input_ids.shape[1]) < lengths[:, None]).long(),
        "loss_mask": pad_sequence(masks, batch_first=True, padding_value=False),
        "old_logprobs": pad_sequence(lps, batch_first=True, padding_value=0.0),
        "weight_version": torch.tensor([row["weight_version"] for row in rows]),
    }


def through_datasets(dataset: object, batch_size: int) -> int:
    """The earlier baseline: row by row, a per-row collate."""
    total = 0
    rows: list[dict] = []
    for row in dataset:  # type: ignore[attr-defined]
        rows.append(row)
        if len(rows) == batch_size:
            total += int(naive_collate(rows)["loss_mask"].count_nonzero())
            rows = []
    if rows:
        total += int(naive_collate(rows)["loss_mask"].count_nonzero())
    return total


def vectorised_collate(batch: dict[str, np.ndarray], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Padding without a Python loop over tokens: per-row lengths, masks, masked assignments."""
    prompts, completions = batch["prompt_token_ids"], batch["completion_token_ids"]
    prompt_len = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
    completion_len = np.fromiter((len(c) for c in completions), np.int64, len(completions))
    lengths = prompt_len + completion_len
    positions = np.arange(int(lengths.max()))[None, :]
    prompt_mask = positions < prompt_len[:, None]
    loss_mask = (positions >= prompt_len[:, None]) & (positions < lengths[:, None])
    input_ids = np.full(prompt_mask.shape, pad_id, dtype=np.int64)
    input_ids[prompt_mask] = np.concatenate(list(prompts))
    input_ids[loss_mask] = np.concatenate(list(completions))
    old_logprobs = np.zeros(prompt_mask.shape, dtype=np.float32)
    old_logprobs[loss_mask] = np.concatenate(list(batch["completion_logprobs"]))
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy((positions < lengths[:, None]).astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask),
        "old_logprobs": torch.from_numpy(old_logprobs),
        "weight_version": torch.from_numpy(np.asarray(batch["weight_version"])),
    }


def through_datasets_vectorised(dataset: object, batch_size: int) -> int:
    """The baseline: `datasets` as numpy, batched, padding vectorised."""
    return sum(int(vectorised_collate(batch)["loss_mask"].count_nonzero())
               for batch in dataset.with_format("numpy").iter(batch_size=batch_size))  # type: ignore[attr-defined]


def timed(fn: Callable[[], int], repeats: int) -> tuple[float, float, int]:
    """Median and best seconds of `repeats` runs (after a warm-up) and what the function returned."""
    result = fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), min(seconds), result


def rewrite_without_numeric_dictionaries(output: str, variant: str) -> None:
    """The same shards with dictionary encoding only for string columns (a writer setting the
    read side would gain from; random token ids and logprobs defeat the dictionary anyway)."""
    for path in sorted(Path(output, RUN).glob("*.parquet")):
        table = pq.read_table(path)
        strings = [f.name for f in table.schema if pa.types.is_string(f.type)]
        target = Path(variant, RUN, path.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, target, compression=COMPRESSION, use_dictionary=strings,
                       write_statistics=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 20, help="completion tokens to read")
    parser.add_argument("--completion", type=int, default=512, help="median completion length")
    parser.add_argument("--p99", type=int, default=4096, help="p99 completion length (lognormal)")
    parser.add_argument("--lengths", choices=("lognormal", "fixed"), default="lognormal")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256, help="rows per training batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-repeats", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=None, help="pin to this core (default: first allowed)")
    args = parser.parse_args()

    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    torch.set_num_threads(1)

    import datasets  # imported late: only the baseline needs it

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        output = str(Path(tmp) / "shards")
        completion_tokens, all_tokens = write_shards(output, args.tokens, args.prompt, args.completion, args.p99,
                                                     args.lengths)
        files = sorted(str(p) for p in Path(output, RUN).glob("*.parquet"))
        print(f"{len(files)} shards, {completion_tokens:,} completion tokens "
              f"({all_tokens:,} with prompts), completions {args.lengths} (median {args.completion}"
              f"{f', p99 {args.p99}' if args.lengths == 'lognormal' else ''}), "
              f"{args.prompt}-token prompts, batches of {args.batch_size} rows, core {cpu}")

        ours_s, ours_best, counted = timed(lambda: ours(output, args.batch_size), args.repeats)
        assert counted == completion_tokens, (counted, completion_tokens)

        decode_s, decode_best, _ = timed(lambda: decode_only(files), args.repeats)

        variant = str(Path(tmp) / "variant")
        rewrite_without_numeric_dictionaries(output, variant)
        variant_s, variant_best, counted = timed(lambda: ours(variant, args.batch_size), args.repeats)
        assert counted == completion_tokens, (counted, completion_tokens)

        start = time.perf_counter()
        hf = datasets.load_dataset(
            "parquet", data_files=files, split="train", cache_dir=str(Path(tmp) / "hf")
        ).select_columns([*TENSOR_COLUMNS])
        load_s = time.perf_counter() - start
        vec_s, vec_best, counted = timed(lambda: through_datasets_vectorised(hf, args.batch_size), args.repeats)
        assert counted == completion_tokens, (counted, completion_tokens)
        hf_s, hf_best, counted = timed(lambda: through_datasets(hf, args.batch_size), args.baseline_repeats)
        assert counted == completion_tokens, (counted, completion_tokens)

    def line(name: str, median: float, best: float, repeats: int) -> str:
        return (f"{name:<9} median {median * 1e3:7.1f} ms (best {best * 1e3:6.1f}) of {repeats}: "
                f"{completion_tokens / median / 1e6:6.1f} M completion tokens/s, "
                f"{all_tokens / median / 1e6:6.1f} M with prompts (best "
                f"{completion_tokens / best / 1e6:.1f} / {all_tokens / best / 1e6:.1f})")

    print(line("ours", ours_s, ours_best, args.repeats))
    print(line("datasets", vec_s, vec_best, args.repeats)
          + f" (numpy, batched, vectorised padding) + {load_s:.2f} s one-time load_dataset, not counted")
    print(f"ratio     {vec_s / ours_s:.1f}x the vectorised datasets path (medians); goal >= 50 M tokens/s and >= 5x")
    print(line("per-row", hf_s, hf_best, args.baseline_repeats) + " (datasets row by row, per-row collate)")
    print(f"          {hf_s / ours_s:.1f}x the per-row path")
    print(f"          of which Parquet decode alone: median {decode_s * 1e3:.1f} ms "
          f"(best {decode_best * 1e3:.1f}); collate and batching the rest")
    print(line("ours*", variant_s, variant_best, args.repeats))
    print("          * same rows, shards written with dictionary encoding for string columns only")


if __name__ == "__main__":
    main()
