"""Where a dataset submit reads its rows: record batches, streamed, of only the columns it needs.

On disk: a Parquet file (read within row groups, `BATCH_ROWS` rows at a time), an Arrow IPC
file or Feather v2 file, an Arrow IPC stream, a directory of Parquet files (in name order),
or a directory written by `datasets.Dataset.save_to_disk`. In memory: a `pyarrow.Table` or
`RecordBatch`, a `pandas.DataFrame`, a `datasets.Dataset`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import ColumnMappingError, PipelineError
from pipeline.core.suggest import missing_file

DATASET_SUFFIXES = (".parquet", ".pq", ".arrow", ".feather", ".ipc")
_PARQUET = (".parquet", ".pq")
# Rows decoded at a time (bounds the submitter's memory besides the jobs it packs).
BATCH_ROWS = 8192

DATASET_KINDS = "a dataset: Parquet, Arrow or Feather, or a directory of them"


def is_dataset_path(path: str | Path) -> bool:
    """A path `pipeline submit` reads as a dataset rather than as JSONL lines."""
    return Path(path).is_dir() or str(path).lower().endswith(DATASET_SUFFIXES)


@dataclass(frozen=True)
class DatasetSource:
    """A dataset's schema, and its record batches of the named top-level columns, read once."""

    name: str
    schema: pa.Schema
    read: Callable[[list[str]], Iterator[pa.RecordBatch]]


def open_path(path: str | Path) -> DatasetSource:
    """A dataset on disk (see the module docstring for the kinds)."""
    target = Path(path)
    if target.is_dir():
        return _directory(target)
    if not target.exists():
        raise PipelineError(missing_file(target, DATASET_KINDS))
    if target.suffix.lower() in _PARQUET:
        return _parquet(str(path), [target])
    return _ipc(str(path), [target])


def open_memory(data: Any) -> DatasetSource:
    """A `pyarrow.Table`/`RecordBatch`, `pandas.DataFrame` or `datasets.Dataset`."""
    module = type(data).__module__
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    elif module.startswith("pandas"):
        data = pa.Table.from_pandas(data, preserve_index=False)
    elif module.startswith("datasets"):
        if not hasattr(data, "with_format"):
            raise PipelineError("a datasets.DatasetDict holds several splits; submit one (dataset['train'])")
        arrow = data.with_format("arrow")  # index mappings (select, shuffle) applied by `datasets`

        def read_dataset(names: list[str]) -> Iterator[pa.RecordBatch]:
            for table in arrow.select_columns(names).iter(batch_size=BATCH_ROWS):
                yield from table.to_batches()

        return DatasetSource("<dataset>", data.data.schema, read_dataset)
    if not isinstance(data, pa.Table):
        raise PipelineError(f"cannot submit a {type(data).__name__}: give a pyarrow.Table, a pandas.DataFrame, "
                            "a datasets.Dataset or a list of request dicts")
    table = data
    return DatasetSource("<table>", table.schema,
                         lambda names: iter(table.select(names).to_batches(max_chunksize=BATCH_ROWS)))


def _same_columns(path: Path, names: Sequence[str], have: Sequence[str], first: Path) -> None:
    missing = [n for n in names if n not in have]
    if missing:
        raise ColumnMappingError(f"{path}: no column {missing[0]!r}, which {first} has")


def _parquet(name: str, paths: Sequence[Path]) -> DatasetSource:
    try:
        schema = pq.read_schema(paths[0])
    except (pa.ArrowException, OSError) as exc:
        raise PipelineError(f"{paths[0]}: not a readable Parquet file ({exc})") from None

    def read(names: list[str]) -> Iterator[pa.RecordBatch]:
        for path in paths:
            with pq.ParquetFile(path) as handle:
                _same_columns(path, names, handle.schema_arrow.names, paths[0])
                yield from handle.iter_batches(batch_size=BATCH_ROWS, columns=names)

    return DatasetSource(name, schema, read)


def _ipc_batches(path: Path) -> tuple[pa.Schema, Iterable[pa.RecordBatch]]:
    source = pa.memory_map(str(path))
    try:
        reader: Any = pa.ipc.open_file(source)  # Arrow IPC file / Feather v2
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        stream = pa.ipc.open_stream(source)  # Arrow IPC stream (what `datasets` writes)
        return stream.schema, stream


def _ipc(name: str, paths: Sequence[Path]) -> DatasetSource:
    try:
        schema, _ = _ipc_batches(paths[0])
    except (pa.ArrowException, OSError) as exc:
        raise PipelineError(f"{paths[0]}: not a readable Arrow IPC or Feather file ({exc})") from None

    def read(names: list[str]) -> Iterator[pa.RecordBatch]:
        for path in paths:
            file_schema, batches = _ipc_batches(path)
            _same_columns(path, names, file_schema.names, paths[0])
            for batch in batches:
                yield from pa.Table.from_batches([batch.select(names)]).to_batches(max_chunksize=BATCH_ROWS)

    return DatasetSource(name, schema, read)


def _directory(path: Path) -> DatasetSource:
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise PipelineError(f"{path} holds a DatasetDict; submit one split's directory ({', '.join(splits)})")
    state = path / "state.json"
    if state.exists():  # `datasets.Dataset.save_to_disk`
        files = [path / entry["filename"] for entry in json.loads(state.read_text()).get("_data_files", [])]
        if not files:
            raise PipelineError(f"{path}: the saved dataset lists no data files in state.json")
        return _ipc(str(path), files)
    parquet = sorted(p for p in path.rglob("*") if p.suffix.lower() in _PARQUET and p.is_file())
    if not parquet:
        raise PipelineError(f"{path}: no Parquet files in this directory, and it is not a directory written by "
                            "datasets' save_to_disk (no state.json)")
    return _parquet(str(path), parquet)
