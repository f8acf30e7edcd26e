"""Reading shards back: a run's rows as a pyarrow Table, from any fsspec URL."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.dataset as pads

from pipeline.storage import arrow_filesystem, join, url_to_fs
from schemas.shard import SHARD_SCHEMA


def shard_paths(url: str) -> tuple[object, list[str]]:
    """The fsspec filesystem and sorted shard paths under `url` (or `url` itself if a shard)."""
    fs, path = url_to_fs(url)
    if path.endswith(".parquet"):
        return fs, [path]
    if not fs.exists(path):
        return fs, []
    files = [
        p for p in fs.find(path)
        if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith(".")
    ]
    return fs, sorted(files)


def rollouts_dataset(urls: str | Sequence[str], run: str | None = None) -> pads.Dataset:
    """A pyarrow Dataset over shards: a run directory, an output root plus `run`, or shard URLs."""
    if isinstance(urls, str):
        fs, files = shard_paths(join(urls, run) if run else urls)
    else:
        fs, files = None, []
        for url in urls:
            fs, found = shard_paths(url)
            files.extend(found)
    if not files or fs is None:
        return pads.dataset(pa.Table.from_batches([], schema=SHARD_SCHEMA))
    return pads.dataset(files, filesystem=arrow_filesystem(fs), format="parquet")


def read_rollouts(
    urls: str | Sequence[str],
    run: str | None = None,
    *,
    columns: list[str] | None = None,
    filter: pads.Expression | None = None,
) -> pa.Table:
    """All rows of the shards under a URL (or of the given shard URLs) as one Table."""
    return rollouts_dataset(urls, run).to_table(columns=columns, filter=filter)
