"""Reading routed experts back: numpy `[rows, layers, top_k]` arrays from shard rows.

A row stores them flattened (`routed_experts`, uint8 when the model has at most 256 experts,
else uint16) with `routed_experts_shape = [rows, layers, top_k]` and `routed_experts_start`.
Row `r` of the array is token position `start + r` of the sequence (prompt, then completion):
the experts each layer routed token `start + r` to while the engine processed it. Positions
run up to `prompt + completion - 1`: the last sampled token was never fed through the model.

Each (position, layer) holds ascending expert ids: the set the router chose; score order is
not kept (the worker sorts them, `workers.rows.table.canonical_routed_experts`). Routing replay
(Megatron's router replay, verl) gathers the trainer's own router scores at the replayed ids
and scatters them into a dense [tokens, experts] map, so it needs the set, not an order.

`routed_experts(table, layers=slice(...), positions=slice(...))` reads from the Arrow list
values buffer with the offsets, slicing layers and positions as index arithmetic into the
flat buffer (numpy strided views), so only the requested block is copied — the slice a
pipeline-parallel rank (its layers) or a context-parallel rank (its positions) needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.core.errors import PipelineError

__all__ = ["ROUTED_EXPERTS_COLUMNS", "routed_experts", "routed_experts_positions"]

ROUTED_EXPERTS_COLUMNS = ["routed_experts", "routed_experts_shape", "routed_experts_start"]


def routed_experts_positions(start: int, rows: int, positions: slice | None) -> range:
    """The token positions a `positions` slice selects among those captured, `[start, start + rows)`.

    `positions` is in token positions of the sequence (not array rows); negative bounds count
    from `start + rows`, as Python slices do. Positions before `start` are not captured and
    are left out.
    """
    end = start + rows
    if positions is None:
        return range(start, end)
    selected = range(*positions.indices(end))
    if selected.step < 1:
        raise PipelineError(f"positions must be an increasing slice, not {positions}")
    first = selected.start
    if first < start:  # the first position on the slice's grid at or after `start`
        first += -(-(start - first) // selected.step) * selected.step
    return range(first, selected.stop, selected.step) if first < selected.stop else range(start, start)


def _block(
    flat: np.ndarray, shape: tuple[int, int, int], start: int, layers: slice | None, positions: slice | None,
    copy: bool,
) -> np.ndarray:
    rows, n_layers, top_k = shape
    if flat.size != rows * n_layers * top_k:
        raise PipelineError(
            f"routed_experts holds {flat.size} ids for shape {list(shape)}; the shard is inconsistent"
        )
    view = flat.reshape(rows, n_layers, top_k)  # a view of the Arrow buffer
    wanted = routed_experts_positions(start, rows, positions)
    view = view[wanted.start - start : wanted.stop - start : wanted.step] if len(wanted) else view[:0]
    if layers is not None:
        view = view[:, layers]
    return np.array(view, copy=True) if copy else view


def _row_shape(shape: Any) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in shape)
    if len(dims) != 3:
        raise PipelineError(f"routed_experts_shape must be [rows, layers, top_k], not {list(dims)}")
    return dims  # type: ignore[return-value]


def _iter_chunks(column: pa.Array | pa.ChunkedArray) -> Iterator[pa.Array]:
    yield from column.chunks if isinstance(column, pa.ChunkedArray) else [column]


def _from_columns(
    experts: pa.Array | pa.ChunkedArray, shapes: pa.Array | pa.ChunkedArray, starts: pa.Array | pa.ChunkedArray,
    layers: slice | None, positions: slice | None, copy: bool,
) -> list[np.ndarray | None]:
    shape_rows = shapes.to_pylist()  # three ints a row: cheap next to the experts
    start_rows = starts.to_pylist()
    out: list[np.ndarray | None] = []
    row = 0
    for chunk in _iter_chunks(experts):
        if isinstance(chunk, pa.LargeListArray | pa.ListArray):
            offsets = chunk.offsets.to_numpy()  # accounts for a sliced chunk
            values = chunk.values  # the whole child array; offsets index into it
        else:
            raise PipelineError(f"routed_experts must be a list column, not {chunk.type}")
        if values.null_count:
            raise PipelineError("routed_experts has null expert ids; the shard is inconsistent")
        flat = values.to_numpy(zero_copy_only=True) if len(values) else np.zeros(0, np.uint8)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False) if chunk.null_count else None
        for i in range(len(chunk)):
            shape = shape_rows[row]
            if (valid is not None and not valid[i]) or shape is None:
                out.append(None)
            else:
                part = flat[offsets[i] : offsets[i + 1]]
                out.append(_block(part, _row_shape(shape), int(start_rows[row] or 0), layers, positions, copy))
            row += 1
    return out


def routed_experts(
    rows: pa.Table | pa.RecordBatch | Mapping[str, Any],
    *,
    layers: slice | None = None,
    positions: slice | None = None,
    copy: bool = True,
) -> np.ndarray | list[np.ndarray | None] | None:
    """The routed experts of shard rows as numpy `[rows, layers, top_k]` arrays.

    - A Table or RecordBatch (with `ROUTED_EXPERTS_COLUMNS`) gives a list, one array per row
      (None where the row has none); a row dict (`table.to_pylist()[i]`) gives one array or None.
    - `layers` selects layers (a slice of layer indices); `positions` selects token positions
      of the sequence (see `routed_experts_positions`): only that block is copied.
    - The dtype is the stored one (uint8 or uint16); `copy=False` returns read-only strided
      views of the Arrow buffer instead of copies.
    - Along the last axis the ids ascend: ascending expert ids per (position, layer), the set
      the router chose; score order is not kept.
    """
    if isinstance(rows, pa.Table | pa.RecordBatch):
        missing = [c for c in ROUTED_EXPERTS_COLUMNS if c not in rows.schema.names]
        if missing:
            raise PipelineError(f"reading routed experts needs columns {missing}; read them with the shard")
        return _from_columns(
            rows.column("routed_experts"), rows.column("routed_experts_shape"),
            rows.column("routed_experts_start"), layers, positions, copy,
        )
    if not isinstance(rows, Mapping):
        raise PipelineError(f"routed_experts takes a Table, RecordBatch or row dict, not {type(rows).__name__}")
    values, shape = rows.get("routed_experts"), rows.get("routed_experts_shape")
    if values is None or shape is None:
        return None
    flat = values if isinstance(values, np.ndarray) else np.asarray(values)
    if flat.dtype.kind not in "ui":
        flat = flat.astype(np.uint16)
    return _block(flat.reshape(-1), _row_shape(shape), int(rows.get("routed_experts_start") or 0),
                  layers, positions, copy)
