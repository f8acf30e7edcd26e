"""Reading shards back: a run's rows as a pyarrow Dataset or Table, from any fsspec URL.

Column projection and filters are pushed down to Parquet (row-group statistics prune whole
shards for `weight_version_between` and `finish_reason_in`). With a Redis connection the
shard list comes from the run's commit log, one shard per job id (the latest commit), so a
rewritten or uncommitted shard is never read twice or half-written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import redis

from pipeline.core.broker import commit_log, keys, registry
from pipeline.core.errors import NoShardsError, PipelineError
from pipeline.core.storage import arrow_filesystem, join, url_to_fs
from pipeline.core.suggest import did_you_mean, listing
from schemas.shard import REWARDS_SCHEMA, REWARDS_SUFFIX, SHARD_SCHEMA, rewards_path

__all__ = [
    "all_of",
    "finish_reason_in",
    "is_location",
    "read_rollouts",
    "request_id_in",
    "rollouts_dataset",
    "shard_paths",
    "weight_version_between",
]


def is_location(source: str) -> bool:
    """A URL, an existing path, or what no run name can be (a '/' in it, a `.parquet` file): a missing
    path then says what is there instead. Anything else names a run (read through its commit log).
    The one rule of every reader (`read_rollouts`, `rollouts_dataset`, `RolloutBatches`,
    `read_trajectories`, `pipeline show`, `verify`, `report`)."""
    return "://" in source or os.path.exists(source) or "/" in source or source.endswith(".parquet")


def shard_paths(url: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The fsspec filesystem and sorted shard paths under `url` (or `url` itself if a shard)."""
    fs, path = url_to_fs(url)
    if path.endswith(".parquet"):
        return fs, [path]
    if not fs.exists(path):
        return fs, []
    files = [
        p for p in fs.find(path)
        if p.endswith(".parquet") and not p.endswith(REWARDS_SUFFIX) and not p.rsplit("/", 1)[-1].startswith(".")
    ]
    return fs, sorted(files)


def _committed_urls(conn: redis.Redis, run: str) -> list[str]:
    """One shard URL per job id of the run (its latest commit), in commit order."""
    urls: list[str] = []
    seen: set[str] = set()
    for commit in commit_log.read_all(conn, run):
        if commit.url not in seen:
            seen.add(commit.url)
            urls.append(commit.url)
    return urls


def _files_of(urls: Sequence[str]) -> tuple[fsspec.AbstractFileSystem | None, list[str]]:
    fs: fsspec.AbstractFileSystem | None = None
    files: list[str] = []
    seen: set[str] = set()
    for url in urls:
        found_fs, found = shard_paths(url)
        if fs is not None and type(found_fs) is not type(fs):
            raise PipelineError(
                f"shard URLs span different filesystems ({type(fs).__name__} and "
                f"{type(found_fs).__name__}); read them separately"
            )
        fs = found_fs
        for path in found:
            if path not in seen:
                seen.add(path)
                files.append(path)
    return fs, files


def rollouts_dataset(
    urls: str | Sequence[str],
    run: str | None = None,
    *,
    conn: redis.Redis | None = None,
    missing_ok: bool = False,
) -> pads.Dataset:
    """A pyarrow Dataset over shards: a run name, a run directory, an output root plus `run`, or shard URLs.

    With `conn` and `run`, the shards are those of the run's commit log (one per job id, the
    latest commit wins) instead of a directory listing; `urls` is then not listed.
    No shard at all raises `NoShardsError` naming what is there, unless `missing_ok`.
    """
    return _dataset(*_shard_files(urls, run, conn, missing_ok=missing_ok))


def _shard_files(
    urls: str | Sequence[str], run: str | None, conn: redis.Redis | None, *, missing_ok: bool = False,
) -> tuple[fsspec.AbstractFileSystem | None, list[str]]:
    if run is None and isinstance(urls, str) and not is_location(urls):  # a run name, as every reader takes
        urls, run = [], urls
        if conn is None:
            from pipeline.core.broker.connection import connect_redis

            conn = connect_redis()
    if conn is not None:
        if run is None:
            raise PipelineError("reading through the commit log needs the run name (run=...)")
        found = _files_of(_committed_urls(conn, run))
    elif isinstance(urls, str):
        target = join(urls, run) if run else urls
        found = _files_of([target])
        if found[1] and target.endswith(".parquet") and found[0] is not None and not found[0].exists(found[1][0]):
            found = (found[0], [])
    else:
        found = _files_of(list(urls))
    if not found[1] and not missing_ok:
        raise _no_shards(urls, run, conn)
    return found


def _no_shards(urls: str | Sequence[str], run: str | None, conn: redis.Redis | None) -> NoShardsError:
    """What was looked for, and what is there instead."""
    if conn is not None:
        assert run is not None
        known = registry.runs(conn)
        return NoShardsError(f"run {run!r} has no committed shard in this Redis (commit log "
                             f"{keys.commit_log(run)} is empty); runs submitted here: {listing(known)}"
                             + did_you_mean(run, known))
    if not isinstance(urls, str):
        if not urls:
            return NoShardsError("no shard URLs to read (nothing committed yet?)")
        return NoShardsError(f"no shards under any of {len(urls)} URL(s): {listing(urls)}")
    target = join(urls, run) if run else urls
    fs, path = url_to_fs(target)
    what = f"{target} (run {run!r} of output {urls})" if run else target
    if fs.exists(path):
        return NoShardsError(f"no shards under {what}: it exists but holds no *.parquet shard")
    parent, _, name = path.rstrip("/").rpartition("/")
    beside = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(parent, detail=False)] \
        if parent and fs.exists(parent) else []
    beside = [b for b in beside if not b.startswith(".") and not b.endswith(REWARDS_SUFFIX)]
    there = (f"{'runs' if run else 'entries'} there: {listing(beside)}" if parent and fs.exists(parent)
             else f"{parent or '/'} does not exist either")
    return NoShardsError(f"no shards under {what}: it does not exist; {there}" + did_you_mean(name, beside))


def _dataset(fs: fsspec.AbstractFileSystem | None, files: list[str]) -> pads.Dataset:
    if not files or fs is None:
        return pads.dataset(pa.Table.from_batches([], schema=SHARD_SCHEMA))
    dataset = pads.dataset(files, filesystem=arrow_filesystem(fs), format="parquet")
    return _widen_routed_experts(dataset, files, fs)


def _widen_routed_experts(dataset: pads.Dataset, files: list[str], fs: fsspec.AbstractFileSystem) -> pads.Dataset:
    """Shards store routed experts as uint8 (<= 256 experts) or uint16; the dataset schema is the
    first shard's, so a run mixing both reads them as uint16 (uint8 shards are cast on read)."""
    schema = dataset.schema
    if "routed_experts" not in schema.names or len(files) < 2:
        return dataset
    field = schema.field("routed_experts")
    if not pa.types.is_list(field.type) or field.type.value_type != pa.uint8():
        return dataset
    wide = schema.set(schema.get_field_index("routed_experts"), field.with_type(pa.list_(pa.uint16())))
    return pads.dataset(files, schema=wide, filesystem=arrow_filesystem(fs), format="parquet")


def read_rollouts(
    urls: str | Sequence[str],
    run: str | None = None,
    *,
    columns: list[str] | None = None,
    filter: pads.Expression | None = None,
    conn: redis.Redis | None = None,
    rewards: bool = False,
    missing_ok: bool = False,
) -> pa.Table:
    """The rows of a run (by name: its commit log, on `conn` or the default Redis), of the shards under
    a URL (plus `run`: that run's directory under an output root), or of the given shard URLs, as one Table.

    `columns` projects, `filter` (see `weight_version_between`, `finish_reason_in`,
    `request_id_in`, combinable with `&`) is pushed down; `conn` dedupes through the commit log.
    `rewards` adds `reward` and `reward_info` from the rewards shards beside the shards (README
    "Rewards"; with `conn`, only rewards recorded in the run's rewards stream); null where a row has none yet.
    No shard at all (a misspelled run or URL) raises `NoShardsError` naming what is there
    ("did you mean"); `missing_ok=True` returns an empty table instead.
    """
    fs, files = _shard_files(urls, run, conn, missing_ok=missing_ok)
    wanted = columns if columns is None or not rewards or "rollout_id" in columns else [*columns, "rollout_id"]
    table = _dataset(fs, files).to_table(columns=wanted, filter=filter)
    if not rewards:
        return table
    table = _join_rewards(table, fs, files, _rewarded_jobs(conn, run) if conn is not None else None)
    return table if wanted == columns else table.drop_columns(["rollout_id"])


def _rewarded_jobs(conn: redis.Redis, run: str | None) -> set[str]:
    """Jobs of the run whose rewards are recorded as written."""
    return {job.decode() for job, state in conn.hgetall(keys.reward_jobs(run or "")).items() if state == b"ok"}


def _join_rewards(table: pa.Table, fs: fsspec.AbstractFileSystem | None, files: list[str],
                  jobs: set[str] | None) -> pa.Table:
    """`table` with `reward` and `reward_info` looked up by `rollout_id` (null where missing)."""
    paths = []
    for path in files:
        beside = rewards_path(path)
        if (jobs is None or path.rsplit("/", 1)[-1][: -len(".parquet")] in jobs) and fs is not None \
                and fs.exists(beside):
            paths.append(beside)
    found = (pads.dataset(paths, schema=REWARDS_SCHEMA, filesystem=arrow_filesystem(fs), format="parquet").to_table()
             if paths and fs is not None else REWARDS_SCHEMA.empty_table())
    return join_rewards(table, found)


def join_rewards(table: pa.Table, found: pa.Table) -> pa.Table:
    """`table` with `reward` and `reward_info` of the rewards table `found`, by `rollout_id` (null where missing)."""
    at = pc.index_in(table.column("rollout_id"), value_set=found.column("rollout_id"))
    return (table.append_column("reward", found.column("reward").take(at))
            .append_column("reward_info", found.column("reward_info").take(at)))


def weight_version_between(low: int | None = None, high: int | None = None) -> pads.Expression:
    """Rows generated by weights `low <= weight_version <= high` (either bound may be open)."""
    field = pc.field("weight_version")
    expr: pads.Expression | None = None
    if low is not None:
        expr = field >= low
    if high is not None:
        upper = field <= high
        expr = upper if expr is None else expr & upper
    return expr if expr is not None else field.is_valid()


def finish_reason_in(*reasons: str) -> pads.Expression:
    """Rows whose `finish_reason` is one of `reasons` (`stop`, `length`, `abort`)."""
    if not reasons:
        raise PipelineError("finish_reason_in needs at least one reason (stop, length, abort)")
    return pc.field("finish_reason").isin(list(reasons))


def request_id_in(request_ids: Iterable[str]) -> pads.Expression:
    """Rows of the given request ids (every sample of each)."""
    return pc.field("request_id").isin(list(request_ids))


def all_of(*exprs: pads.Expression | None) -> pads.Expression | None:
    """The conjunction of the given filters, ignoring `None`s (`None` when none is left)."""
    result: pads.Expression | None = None
    for expr in exprs:
        if expr is not None:
            result = expr if result is None else result & expr
    return result
