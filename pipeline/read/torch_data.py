"""Shard rows to training tensors: a vectorized collate and a group-aware IterableDataset.

With `pipeline.read.importance`, the only modules of `pipeline` that import torch; `import pipeline`
never does.

Every sequence is the prompt followed by the completion. Per position `t` of a sequence:

- `input_ids[t]`: the token (prompt, then completion, verbatim as sampled);
- `loss_mask[t]` (bool): True where `input_ids[t]` is a completion token;
- `old_logprobs[t]`: the engine's logprob of `input_ids[t]` where it is a completion token
  (0 elsewhere, and 0 for rows stored without logprobs). A causal LM predicts token `t` from
  position `t - 1`, so compare `logits[:, :-1]` with `input_ids[:, 1:]`, `loss_mask[:, 1:]`
  and `old_logprobs[:, 1:]`;
- `token_weight_version[t]` (int64): the weight version that generated `input_ids[t]` where it
  is a completion token, -1 elsewhere. A row continued across a partial weight swap has several
  (`weight_version_segments`); `old_logprobs[t]` is always the logprob under this version (the
  behaviour policy of that token), so staleness per token is `current_version -
  token_weight_version` on the loss mask.

Layouts: `padded` gives `[B, T]` tensors, right-padded with `pad_id`, plus `attention_mask`
(bool, True on real tokens; Hugging Face models take it as is, `.long()` for others);
`packed` concatenates the sequences into `[1, N]` tensors with `position_ids` restarting at
every sequence and `cu_seqlens` (`[B + 1]`, int32, flash-attention varlen style) and
`max_seqlen`. Both carry `weight_version` and `group_index` (`[B]`, the request group of each
sequence within the batch, for GRPO advantages). `RolloutBatches(rewards=True)` adds `rewards`
(`[B]`, float32, NaN where a row has none) from the rewards shards beside the shards, and
`advantages=True` the group-normalised `advantages` (`grpo_advantages`).

Routed experts (`routed_experts=True`, for routing replay): `routed_experts` is `[B, T, layers,
top_k]` (padded) or `[1, N, layers, top_k]` (packed), aligned to the same token positions as
`input_ids`: the ids at position `t` are the experts each layer routed token `t` to while the
rollout engine processed it, i.e. what replaying the forward over `input_ids` must use at `t`.
`routed_experts_mask` (bool, `[B, T]` or `[1, N]`) is True where ids were captured: positions
`[start, prompt + completion - 1)`; the last token (never fed to the engine), padding and rows
stored without routed experts are False and hold 0. The dtype is uint8 when every batch row was
stored as uint8 (models with at most 256 experts), else int32 (torch has no general uint16);
`.long()` them for indexing.

Tensors are built from Arrow's list offsets and values with numpy (boolean-mask scatters), never
with a Python loop over tokens, and handed to torch without a copy.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import redis
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.core.errors import PipelineError
from pipeline.core.routed_experts import ROUTED_EXPERTS_COLUMNS
from pipeline.core.shards import join_rewards, rollouts_dataset
from schemas.shard import REWARDS_SCHEMA, rewards_path

Layout = Literal["padded", "packed"]
TableLike = pa.Table | pa.RecordBatch

# The columns the collate reads; `request_id` only for grouping.
TENSOR_COLUMNS = ["prompt_token_ids", "completion_token_ids", "completion_logprobs", "weight_version"]
# Read when present (shards written before per-token versions lack it: every token is `weight_version`).
SEGMENTS_COLUMN = "weight_version_segments"
GROUP_COLUMN = "request_id"

__all__ = [
    "SEGMENTS_COLUMN",
    "TENSOR_COLUMNS",
    "RolloutBatches",
    "collate_rollouts",
    "group_boundaries",
    "group_rows",
    "grpo_advantages",
    "pack_groups",
]


@dataclass(frozen=True)
class _ListParts:
    """A list column as per-chunk flat values, per-row lengths, and which rows are non-null."""

    values: list[np.ndarray]  # one flat array per chunk (nulls skipped)
    row_starts: list[int]  # first row of each chunk
    lengths: np.ndarray  # int64 per row, 0 for a null row
    valid: np.ndarray | None  # bool per row, None when no row is null


def _list_parts(column: pa.Array | pa.ChunkedArray) -> _ListParts:
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values: list[np.ndarray] = []
    row_starts: list[int] = []
    lengths: list[np.ndarray] = []
    valids: list[np.ndarray] = []
    any_null = False
    row = 0
    for chunk in chunks:
        chunk_lengths = np.diff(chunk.offsets.to_numpy()).astype(np.int64, copy=False)
        if chunk.null_count:
            any_null = True
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            chunk_lengths = np.where(valid, chunk_lengths, 0)
        else:
            valid = np.ones(len(chunk), dtype=bool)
        flat = chunk.flatten()
        values.append(flat.to_numpy(zero_copy_only=flat.null_count == 0))
        row_starts.append(row)
        row += len(chunk)
        lengths.append(chunk_lengths)
        valids.append(valid)
    if len(chunks) == 1:
        return _ListParts(values, row_starts, lengths[0], valids[0] if any_null else None)
    return _ListParts(
        values,
        row_starts,
        np.concatenate(lengths) if lengths else np.empty(0, np.int64),
        np.concatenate(valids) if any_null else None,
    )


def _empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An uninitialized writable array in Arrow's memory pool (mimalloc/jemalloc), which keeps
    freed pages for the next batch: glibc malloc hands batch-sized arrays back to the kernel and
    page-faults them in again every batch (~20% of the collate)."""
    itemsize = np.dtype(dtype).itemsize
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(pa.allocate_buffer(max(1, count * itemsize)), dtype=dtype, count=count).reshape(shape)


def _fill(dest: np.ndarray, mask: np.ndarray, parts: _ListParts, row_span: np.ndarray) -> None:
    """Scatter each chunk's values into `dest[mask]`, chunk by chunk (no concatenation).

    `row_span[r]` is where row `r` starts along the first axis of `dest` and `mask`
    (the row itself for a padded `[B, T]` layout, its token offset for a packed one).
    """
    if not parts.values:
        return
    ends = [*parts.row_starts[1:], len(row_span) - 1]
    for values, first, last in zip(parts.values, parts.row_starts, ends, strict=True):
        lo, hi = int(row_span[first]), int(row_span[last])
        dest[lo:hi][mask[lo:hi]] = values


def _column(rows: TableLike, name: str) -> pa.Array | pa.ChunkedArray:
    if name not in rows.schema.names:
        raise PipelineError(
            f"collate needs column {name!r}; read the shards with columns including {TENSOR_COLUMNS}"
        )
    return rows.column(name)


def _int_column(rows: TableLike, name: str) -> np.ndarray:
    column = _column(rows, name)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _logprob_rows(
    logprobs: _ListParts, completion_lengths: np.ndarray
) -> np.ndarray:
    """Which rows carry logprobs; checks the one-logprob-per-completion-token invariant."""
    has = np.ones(len(completion_lengths), bool) if logprobs.valid is None else logprobs.valid
    bad = np.flatnonzero(has & (logprobs.lengths != completion_lengths))
    if bad.size:
        row = int(bad[0])
        raise PipelineError(
            f"row {row}: {int(logprobs.lengths[row])} completion logprobs for "
            f"{int(completion_lengths[row])} completion tokens; the shard breaks the logprob contract"
        )
    return has


def _token_versions(rows: TableLike, weight_version: np.ndarray, completion_lengths: np.ndarray) -> _ListParts:
    """Every completion token's weight version, flat in row order, from the run-length segments
    (a null row, or a table without the column: all tokens from the row's `weight_version`)."""
    n_rows = len(weight_version)
    seg_rows = np.arange(n_rows, dtype=np.int64)
    seg_starts = np.zeros(n_rows, dtype=np.int64)
    seg_versions = weight_version.astype(np.int64, copy=True)
    if SEGMENTS_COLUMN in rows.schema.names and n_rows:
        column = rows.column(SEGMENTS_COLUMN)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if column.null_count < n_rows:
            counts = np.diff(column.offsets.to_numpy()).astype(np.int64)
            if column.null_count:
                counts = np.where(column.is_valid().to_numpy(zero_copy_only=False), counts, 0)
            flat = column.flatten()
            starts = flat.field("start").to_numpy(zero_copy_only=False).astype(np.int64)
            versions = flat.field("version").to_numpy(zero_copy_only=False).astype(np.int64)
            segmented = counts > 0
            keep = ~segmented  # rows whose one version is `weight_version`
            seg_rows = np.concatenate([seg_rows[keep], np.repeat(np.arange(n_rows), counts)])
            seg_starts = np.concatenate([seg_starts[keep], starts])
            seg_versions = np.concatenate([seg_versions[keep], versions])
            order = np.lexsort((seg_starts, seg_rows))
            seg_rows, seg_starts, seg_versions = seg_rows[order], seg_starts[order], seg_versions[order]
    ends = np.empty_like(seg_starts)
    ends[:-1] = np.where(seg_rows[1:] == seg_rows[:-1], seg_starts[1:], completion_lengths[seg_rows[:-1]])
    if ends.size:
        ends[-1] = completion_lengths[seg_rows[-1]]
    spans = ends - seg_starts
    if np.any(spans < 0) or np.any(seg_starts[spans == 0] != 0):
        row = int(seg_rows[np.flatnonzero((spans < 0) | ((spans == 0) & (seg_starts != 0)))[0]])
        raise PipelineError(f"row {row}: weight_version_segments do not fit its completion; the shard is inconsistent")
    values = np.repeat(seg_versions, np.maximum(spans, 0))
    return _ListParts([values], [0], completion_lengths, None)


def _routed_experts(
    rows: TableLike, lengths: np.ndarray, mask_of: Any, row_span: np.ndarray, total_shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """Routed experts scattered onto the token layout; `mask_of(first, stop)` is the layout's
    mask of positions `first[r] <= t < stop[r]` of each row `r`."""
    experts = _list_parts(_column(rows, "routed_experts"))
    shape_parts = _list_parts(_column(rows, "routed_experts_shape"))
    start_column = pc.fill_null(_column(rows, "routed_experts_start"), 0)
    starts = np.asarray(start_column, dtype=np.int64) if len(lengths) else np.zeros(0, np.int64)
    has = np.ones(len(lengths), bool) if experts.valid is None else experts.valid
    shapes = np.zeros((len(lengths), 3), dtype=np.int64)
    if shape_parts.values:
        flat_shapes = np.concatenate(shape_parts.values).astype(np.int64)
        if flat_shapes.size != 3 * int(has.sum()):
            raise PipelineError("routed_experts_shape must be [rows, layers, top_k] on every row with experts")
        shapes[has] = flat_shapes.reshape(-1, 3)
    widths = np.unique(shapes[has, 1] * shapes[has, 2])
    if widths.size > 1:
        raise PipelineError(f"rows of one batch route different layers x top_k ({sorted(widths.tolist())})")
    n_routed = np.where(has, shapes[:, 0], 0)
    starts = np.where(has, starts, 0)
    bad = np.flatnonzero(has & ((experts.lengths != shapes.prod(axis=1)) | (starts + n_routed > lengths - 1)))
    if bad.size:
        r = int(bad[0])
        raise PipelineError(
            f"row {r}: routed_experts of shape {shapes[r].tolist()} from position {int(starts[r])} "
            f"do not fit {int(experts.lengths[r])} ids and {int(lengths[r])} tokens; the shard is inconsistent"
        )
    layers_k = (int(shapes[has, 1][0]), int(shapes[has, 2][0])) if widths.size else (0, 0)
    value_types = {v.dtype for v in experts.values if v.size}
    dtype = np.uint8 if value_types <= {np.dtype(np.uint8)} else np.int32
    mask = mask_of(starts, starts + n_routed)
    dest = np.zeros((*total_shape, layers_k[0] * layers_k[1]), dtype=dtype)
    width = max(1, layers_k[0] * layers_k[1])
    parts = _ListParts([v.reshape(-1, width) for v in experts.values], experts.row_starts, n_routed, experts.valid)
    _fill(dest, mask, parts, row_span)
    return {
        "routed_experts": torch.from_numpy(dest.reshape(*total_shape, *layers_k)),
        "routed_experts_mask": torch.from_numpy(mask),
    }


def collate_rollouts(
    rows: TableLike,
    *,
    layout: Layout = "padded",
    pad_id: int = 0,
    pad_to_multiple_of: int | None = None,
    group_index: np.ndarray | None = None,
    routed_experts: bool = False,
) -> dict[str, torch.Tensor | int]:
    """Training tensors from shard rows (a Table or RecordBatch with `TENSOR_COLUMNS`).

    `group_index` (`[B]`) is passed through as a tensor; without it every row is its own group.
    `routed_experts=True` adds `routed_experts` and `routed_experts_mask` aligned to the token
    layout (see the module docstring); the rows then need `ROUTED_EXPERTS_COLUMNS` too.
    """
    prompts = _list_parts(_column(rows, "prompt_token_ids"))
    completions = _list_parts(_column(rows, "completion_token_ids"))
    logprobs = _list_parts(_column(rows, "completion_logprobs"))
    weight_version = _int_column(rows, "weight_version")
    p, c = prompts.lengths, completions.lengths
    has_lp = _logprob_rows(logprobs, c)
    lengths = p + c
    n_rows = len(lengths)
    groups = np.arange(n_rows, dtype=np.int64) if group_index is None else group_index
    common = {
        "weight_version": torch.from_numpy(np.array(weight_version, dtype=np.int64)),
        "group_index": torch.from_numpy(np.array(groups, dtype=np.int64)),
    }

    if layout == "padded":
        width = int(lengths.max()) if n_rows else 0
        if pad_to_multiple_of:
            width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        # Masks from the narrowest integer positions (2-3x faster compares than int64).
        small = np.int16 if width < 2**15 else np.int32 if width < 2**31 else np.int64
        positions = np.arange(width, dtype=small)
        attention = np.less(positions, lengths.astype(small)[:, None], out=_empty((n_rows, width), np.bool_))
        prompt_mask = np.less(positions, p.astype(small)[:, None], out=_empty((n_rows, width), np.bool_))
        completion_mask = np.logical_xor(attention, prompt_mask, out=_empty((n_rows, width), np.bool_))
        span = np.arange(n_rows + 1)
        input_ids = _empty((n_rows, width), np.int64)
        input_ids.fill(pad_id)
        _fill(input_ids, prompt_mask, prompts, span)
        _fill(input_ids, completion_mask, completions, span)
        old_logprobs = _empty((n_rows, width), np.float32)
        old_logprobs.fill(0.0)
        lp_mask = completion_mask if logprobs.valid is None else completion_mask & has_lp[:, None]
        _fill(old_logprobs, lp_mask, logprobs, span)
        token_versions = _empty((n_rows, width), np.int64)
        token_versions.fill(-1)
        _fill(token_versions, completion_mask, _token_versions(rows, weight_version, c), span)
        routed = (
            _routed_experts(
                rows, lengths, lambda first, stop: (positions >= first[:, None]) & (positions < stop[:, None]),
                span, (n_rows, width),
            )
            if routed_experts else {}
        )
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(completion_mask),
            "old_logprobs": torch.from_numpy(old_logprobs),
            "token_weight_version": torch.from_numpy(token_versions),
            **routed,
            **common,
        }
    if layout == "packed":
        cu_seqlens = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1])
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1], lengths)
        completion_mask = position_ids >= np.repeat(p, lengths)
        input_ids = np.empty(total, dtype=np.int64)
        _fill(input_ids, ~completion_mask, prompts, cu_seqlens)
        _fill(input_ids, completion_mask, completions, cu_seqlens)
        old_logprobs = np.zeros(total, dtype=np.float32)
        lp_mask = (
            completion_mask if logprobs.valid is None
            else completion_mask & np.repeat(has_lp, lengths)
        )
        _fill(old_logprobs, lp_mask, logprobs, cu_seqlens)
        token_versions = np.full(total, -1, dtype=np.int64)
        _fill(token_versions, completion_mask, _token_versions(rows, weight_version, c), cu_seqlens)
        routed = (
            _routed_experts(
                rows, lengths,
                lambda first, stop: (position_ids >= np.repeat(first, lengths))
                & (position_ids < np.repeat(stop, lengths)),
                cu_seqlens, (total,),
            )
            if routed_experts else {}
        )
        if routed:
            routed = {name: tensor.unsqueeze(0) for name, tensor in routed.items()}
        return {
            "input_ids": torch.from_numpy(input_ids).unsqueeze(0),
            "position_ids": torch.from_numpy(position_ids).unsqueeze(0),
            "loss_mask": torch.from_numpy(completion_mask).unsqueeze(0),
            "old_logprobs": torch.from_numpy(old_logprobs).unsqueeze(0),
            "token_weight_version": torch.from_numpy(token_versions).unsqueeze(0),
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
            "max_seqlen": int(lengths.max()) if n_rows else 0,
            **routed,
            **common,
        }
    raise PipelineError(f"layout must be 'padded' or 'packed', not {layout!r}")


def group_rows(table: pa.Table, column: str = GROUP_COLUMN) -> tuple[pa.Table, np.ndarray]:
    """The table with each request's rows made adjacent (groups in order of first appearance,
    rows in their order within a group), and the group code of every row."""
    ids = table.column(column)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.chunk(0) if ids.num_chunks == 1 else ids.combine_chunks()
    # Read as dictionary (`RolloutBatches` asks Parquet for that), the codes are already there.
    encoded = ids if pa.types.is_dictionary(ids.type) else ids.dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    if codes.size and np.count_nonzero(codes[1:] != codes[:-1]) + 1 != int(codes.max()) + 1:
        order = np.argsort(codes, kind="stable")
        return table.take(pa.array(order)), codes[order]
    return table, codes


def group_boundaries(codes: np.ndarray) -> np.ndarray:
    """Start offsets of each run of equal codes, plus the total length at the end."""
    if not codes.size:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(codes[1:] != codes[:-1]) + 1
    return np.concatenate([[0], starts, [codes.size]]).astype(np.int64)


def pack_groups(group_sizes: Sequence[int] | np.ndarray, batch_size: int, carried: int = 0) -> list[int]:
    """Greedy cut points (group counts per batch) keeping whole groups, at most `batch_size` rows
    per batch unless one group alone is larger; the first batch already holds `carried` rows."""
    counts: list[int] = []
    rows, groups = carried, 0
    for size in group_sizes:
        if rows + size > batch_size and rows > 0:
            counts.append(groups)
            rows, groups = 0, 0
        rows += int(size)
        groups += 1
    counts.append(groups)
    return counts


class RolloutBatches(IterableDataset):
    """Training batches over a run's shards, group-aware: every sample of a request is in the
    same batch. Use with `DataLoader(dataset, batch_size=None)`; DataLoader workers split the
    shards between them.

    A request's samples are in one shard (a job carries whole requests), so groups are formed
    per shard; batches fill with whole groups, across shards, up to `batch_size` rows.
    """

    def __init__(
        self,
        source: str | Sequence[str] | pads.Dataset,
        *,
        run: str | None = None,
        conn: redis.Redis | None = None,
        batch_size: int = 64,
        layout: Layout = "padded",
        pad_id: int = 0,
        pad_to_multiple_of: int | None = None,
        filter: pads.Expression | None = None,
        extra_columns: Sequence[str] = (),
        group_by_request: bool = True,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        use_threads: bool = True,
        routed_experts: bool = False,
        rewards: bool = False,
        advantages: bool = False,
        advantage_eps: float = 1e-6,
        trajectories: bool = False,
    ) -> None:
        """`trajectories=True`: batches of agent episodes instead of rows (`pipeline.read.trajectory_batches`:
        `source` a run name, a URL or a Table of rows; `batch_size` episodes a batch)."""
        super().__init__()
        self.trajectories = trajectories
        if trajectories:
            if not isinstance(source, str | pa.Table):
                raise PipelineError("trajectories=True reads a run name, a shard URL or a Table of rows")
            self.source, self.conn = source, conn
            self.batch_size, self.pad_id, self.pad_to_multiple_of = batch_size, pad_id, pad_to_multiple_of
            self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
            return
        if advantages and not (rewards and group_by_request):
            raise PipelineError("advantages are normalised within request groups: pass rewards=True and keep "
                                "group_by_request=True")
        if batch_size < 1:
            raise PipelineError(f"batch_size must be at least 1, not {batch_size}")
        self.dataset = (
            source if isinstance(source, pads.Dataset) else rollouts_dataset(source, run, conn=conn)
        )
        self.batch_size = batch_size
        self.layout: Layout = layout
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.filter = filter
        self.extra_columns = list(extra_columns)
        self.group_by_request = group_by_request
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.use_threads = use_threads
        self.routed_experts = routed_experts
        self.rewards = rewards
        self.advantages = advantages
        self.advantage_eps = advantage_eps
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle differently in the next pass (with `shuffle=True`)."""
        self.epoch = epoch

    def _columns(self) -> list[str]:
        wanted = [*TENSOR_COLUMNS, *self.extra_columns]
        if SEGMENTS_COLUMN in self.dataset.schema.names:
            wanted.append(SEGMENTS_COLUMN)
        if self.routed_experts:
            wanted.extend(ROUTED_EXPERTS_COLUMNS)
        if self.group_by_request:
            wanted.append(GROUP_COLUMN)
        if self.rewards:
            wanted.append("rollout_id")
        return list(dict.fromkeys(wanted))

    def _fragments(self) -> list[pads.Fragment]:
        fragments = list(self.dataset.get_fragments())
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(fragments)
        info = get_worker_info()
        if info is not None:
            fragments = fragments[info.id :: info.num_workers]
        return fragments

    def _read(self, fragment: pads.Fragment) -> pa.Table:
        """The needed columns of one shard, its rewards joined when asked."""
        table = self._read_rows(fragment)
        if not self.rewards:
            return table
        beside = rewards_path(fragment.path)
        found = (pq.read_table(beside, filesystem=fragment.filesystem)
                 if fragment.filesystem.get_file_info(beside).type == pafs.FileType.File
                 else REWARDS_SCHEMA.empty_table())
        return join_rewards(table, found)

    def _read_rows(self, fragment: pads.Fragment) -> pa.Table:
        """The needed columns of one shard; a plain Parquet read (memory-mapped where local)
        unless a filter needs the dataset scanner's row-group pruning."""
        if self.filter is None and isinstance(fragment, pads.ParquetFileFragment):
            local = isinstance(fragment.filesystem, pafs.LocalFileSystem)
            # The group column as Parquet stored it, dictionary codes, not strings decoded then hashed.
            parquet = pq.ParquetFile(fragment.path, filesystem=fragment.filesystem, memory_map=local,
                                     read_dictionary=[GROUP_COLUMN] if self.group_by_request else None)
            wanted = self._columns()
            present = set(parquet.schema_arrow.names)
            if all(c in present for c in wanted):
                return parquet.read(columns=wanted, use_threads=self.use_threads)
        return fragment.to_table(
            schema=self.dataset.schema, columns=self._columns(), filter=self.filter,
            use_threads=self.use_threads,
        )

    def _shard_tables(self) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """Each shard's rows, groups adjacent (shuffled if asked), with per-row group codes."""
        rng = np.random.default_rng([self.seed, self.epoch])
        for fragment in self._fragments():
            table = self._read(fragment)
            if not table.num_rows:
                continue
            if not self.group_by_request:
                codes = np.arange(table.num_rows, dtype=np.int64)
                if self.shuffle:
                    order = rng.permutation(table.num_rows)
                    table = table.take(pa.array(order))
                yield table, codes
                continue
            table, codes = group_rows(table)
            if self.shuffle:
                bounds = group_boundaries(codes)
                sizes = np.diff(bounds)
                perm = rng.permutation(sizes.size)
                new_sizes = sizes[perm]
                new_starts = np.repeat(bounds[:-1][perm], new_sizes)
                offsets = np.arange(codes.size) - np.repeat(np.cumsum(new_sizes) - new_sizes, new_sizes)
                order = new_starts + offsets
                table, codes = table.take(pa.array(order)), codes[order]
            yield table, codes

    def _emit(self, parts: list[tuple[pa.Table, np.ndarray]]) -> dict[str, Any]:
        # "permissive": shards of one run may store routed experts as uint8 and as uint16.
        table = pa.concat_tables([t for t, _ in parts], promote_options="permissive") if len(parts) > 1 else parts[0][0]
        indices: list[np.ndarray] = []
        offset = 0
        for _, codes in parts:  # groups numbered 0..G-1 across the parts of this batch
            index = group_boundaries_to_index(codes) + offset
            indices.append(index)
            offset = int(index[-1]) + 1 if index.size else offset
        group_index = np.concatenate(indices)
        batch: dict[str, Any] = dict(
            collate_rollouts(
                table, layout=self.layout, pad_id=self.pad_id,
                pad_to_multiple_of=self.pad_to_multiple_of, group_index=group_index,
                routed_experts=self.routed_experts,
            )
        )
        for name in self.extra_columns:
            batch[name] = table.column(name).to_pylist()
        if self.rewards:
            rewards = pc.fill_null(table.column("reward"), float("nan")).to_numpy().astype(np.float32)
            batch["rewards"] = torch.from_numpy(rewards)
            if self.advantages:
                batch["advantages"] = torch.from_numpy(grpo_advantages(rewards, group_index, self.advantage_eps))
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.trajectories:
            from pipeline.read.trajectory_batches import trajectory_batches

            yield from trajectory_batches(self.source, conn=self.conn, batch_size=self.batch_size, pad_id=self.pad_id,
                                          pad_to_multiple_of=self.pad_to_multiple_of, shuffle=self.shuffle,
                                          seed=self.seed + self.epoch, drop_last=self.drop_last)
            return
        pending: list[tuple[pa.Table, np.ndarray]] = []
        pending_rows = 0
        for table, codes in self._shard_tables():
            bounds = group_boundaries(codes)
            cuts = pack_groups(np.diff(bounds), self.batch_size, carried=pending_rows)
            group_at = 0
            for batch_no, n_groups in enumerate(cuts):
                lo, hi = int(bounds[group_at]), int(bounds[group_at + n_groups])
                group_at += n_groups
                if hi > lo:
                    pending.append((table.slice(lo, hi - lo), codes[lo:hi]))
                    pending_rows += hi - lo
                if batch_no < len(cuts) - 1:  # this batch is closed by the next group
                    yield self._emit(pending)
                    pending, pending_rows = [], 0
            if pending_rows >= self.batch_size:
                yield self._emit(pending)
                pending, pending_rows = [], 0
        if pending and (pending_rows >= self.batch_size or not self.drop_last):
            yield self._emit(pending)


def grpo_advantages(rewards: np.ndarray, group_index: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO's group-normalised advantages: (r - mean) / (std + eps) within each group (`group_index`
    numbers rows 0..G-1; std with Bessel's correction, as TRL and DeepSeekMath; 0 for a group of one).
    `PipelineError` if a reward is missing (NaN): its group's advantages would be meaningless."""
    if np.isnan(rewards).any():
        raise PipelineError(f"{int(np.isnan(rewards).sum())} row(s) of this batch have no reward (rewards not "
                            "recorded yet, or their reward function failed); see `pipeline status`")
    groups = int(group_index.max()) + 1 if group_index.size else 0
    counts = np.bincount(group_index, minlength=groups).astype(np.float64)
    mean = np.bincount(group_index, weights=rewards, minlength=groups) / counts
    centred = rewards - mean[group_index]
    squares = np.bincount(group_index, weights=centred**2, minlength=groups)
    std = np.sqrt(np.divide(squares, counts - 1, out=np.zeros(groups), where=counts > 1))
    return (centred / (std[group_index] + eps)).astype(np.float32)


def group_boundaries_to_index(codes: np.ndarray) -> np.ndarray:
    """Per-row group numbers 0..G-1 for rows whose groups are adjacent runs of equal codes."""
    if not codes.size:
        return np.zeros(0, dtype=np.int64)
    change = np.zeros(codes.size, dtype=np.int64)
    change[1:] = codes[1:] != codes[:-1]
    return np.cumsum(change)
