"""Requests from columnar datasets, validated by column: Parquet, Arrow/Feather, a directory of
Parquet files, a `datasets.save_to_disk` directory, or a `pyarrow.Table`, `pandas.DataFrame` or
`datasets.Dataset` in memory.

A `ColumnMapping` says which column holds each request field (`input_ids=prompt_ids`, dotted
paths into struct columns: `messages=prompt`, metadata keys `answer=reward_model.ground_truth`),
and gives default sampling parameters. Columns named like a request field are taken without
being named; the id defaults to the 0-based row index.

The guarantees are those of a JSONL submit: every row is checked (types, ranges, vocabulary,
the stop contract) before anything is enqueued; problems name the 0-based row index and the
column (`DatasetError`, at most 20 listed); one bad row rejects the whole dataset. Files are
read record batch by record batch (Parquet: within row groups), never whole. Prompt ids stay in
the Arrow list column's values buffer: each row's ids are a numpy view into it, range-checked
per row by `np.minimum/maximum.reduceat`, and copied once into the staged Redis value.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from pipeline.core.errors import ColumnMappingError, DatasetError, RenderError, RowError
from pipeline.submit.dataset_source import DatasetSource
from pipeline.submit.request_file import (
    ParsedRequest,
    SamplingShape,
    StepAside,
    fast_fields,
    validation_errors,
)
from schemas import request as request_schema
from schemas.chat import CHAT_FIELDS, CHAT_INPUTS, SHARED_FIELDS
from schemas.request import (
    MAX_ID_CHARS,
    MAX_SEED,
    MAX_TOKEN_ID,
    RolloutRequest,
    SamplingParams,
    outside_vocabulary,
    prompt_too_long,
)

_SAMPLING_NAMES = frozenset(SamplingParams.model_fields)
# Request fields a column may fill: the ids or a chat input, the fields every line has
# (`SHARED_FIELDS`: id, sampling_params, ...), the chat options and single sampling parameters.
_TARGETS = frozenset(SHARED_FIELDS) | {"input_ids"} | CHAT_FIELDS | _SAMPLING_NAMES


@dataclass(frozen=True)
class ColumnMapping:
    """Which column fills each request field, metadata keys from columns, default sampling parameters.

    `columns`: request field (`input_ids`, `id`, `messages`, `prompt`, `sampling_params`, a
    sampling parameter such as `temperature`, `logprobs`, `metadata`, ...) -> column path.
    `metadata`: metadata key -> column path. Paths are dotted into struct columns.
    `sampling`: sampling parameters for every row (a row's own columns win).
    """

    columns: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.columns) - _TARGETS)
        if unknown:
            raise ColumnMappingError(
                f"--column {unknown[0]}=...: {unknown[0]!r} is not a request field; map one of "
                f"{', '.join(sorted(_TARGETS))}"
            )
        if "metadata" in self.columns and self.metadata:
            raise ColumnMappingError("give metadata either as one struct column (--column metadata=COL) or key by "
                                     "key (--metadata KEY=COL), not both")
        try:
            SamplingParams.model_validate(dict(self.sampling))
        except ValidationError as exc:
            problems = "; ".join(f"{e.field}: {e.message}" for e in validation_errors("", 0, exc))
            raise ColumnMappingError(f"default sampling parameters: {problems}") from None

    @classmethod
    def parse(cls, columns: Iterable[str] = (), metadata: Iterable[str] = (),
              sampling: Mapping[str, Any] | None = None) -> ColumnMapping:
        """From the command line's `FIELD=COLUMN` pairs (`--column`, `--metadata`)."""
        return cls(_pairs(columns, "--column"), _pairs(metadata, "--metadata"), dict(sampling or {}))

    def resolve(self, schema: pa.Schema) -> dict[str, str]:
        """Field -> column path for this schema: the mapping, plus columns named like a field."""
        mapped = dict(self.columns)
        for name in schema.names:
            if name in _TARGETS and name not in mapped and name not in mapped.values() and name not in _SAMPLING_NAMES:
                mapped[name] = name
        if "metadata" in mapped and self.metadata:
            del mapped["metadata"]
        for name, path in [*mapped.items(), *((f"metadata.{k}", p) for k, p in self.metadata.items())]:
            kind = _column(schema, path, name).type  # every path must exist before any row is read
            if name.startswith("metadata") and not _plain_json(kind):
                raise ColumnMappingError(
                    f"{name}: column {path!r} is {kind}; metadata must be plain JSON (numbers, strings, bools, "
                    "lists and structs of them): cast the column first"
                )
        inputs = [name for name in ("input_ids", *CHAT_INPUTS) if name in mapped]
        if len(inputs) != 1:
            given = f"columns for {' and '.join(inputs)}" if inputs else "no input_ids, messages or prompt column"
            raise ColumnMappingError(
                f"the dataset needs exactly one prompt input, found {given} (columns: {', '.join(schema.names)}); "
                "map one with --column input_ids=COL, --column messages=COL or --column prompt=COL"
            )
        return mapped


def _plain_json(kind: pa.DataType) -> bool:
    """Values of this Arrow type come out of `to_pylist` as plain JSON (no dates, bytes, decimals)."""
    if pa.types.is_dictionary(kind):
        return _plain_json(kind.value_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _plain_json(kind.value_type)
    if pa.types.is_struct(kind):
        return all(_plain_json(kind.field(i).type) for i in range(kind.num_fields))
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind))


def _pairs(items: Iterable[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ColumnMappingError(f"{flag} {item!r}: write NAME=COLUMN (a dotted path for a struct field)")
        if name in out:
            raise ColumnMappingError(f"{flag} {name}= is given twice")
        out[name] = path
    return out


def _head(path: str, names: Sequence[str]) -> str | None:
    """The top-level column a dotted path starts in (the longest name that matches: names may hold dots)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in names:
            return head
    return None


def _column(table: pa.Schema | pa.RecordBatch, path: str, target: str) -> Any:
    """The field (of a schema) or array (of a batch) at a dotted path; `ColumnMappingError` if absent."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    head = _head(path, schema.names)
    if head is not None:
        node = schema.field(head) if isinstance(table, pa.Schema) else table.column(head)
        for part in path[len(head):].split(".")[1:]:
            if not pa.types.is_struct(node.type) or node.type.get_field_index(part) < 0:
                break
            node = node.type.field(part) if isinstance(table, pa.Schema) else _struct_field(node, part)
        else:
            return node
    raise ColumnMappingError(
        f"{target}: the dataset has no column {path!r} (columns: {', '.join(schema.names)}; "
        "dotted paths reach into struct columns)"
    )


def columns_needed(mapped: Mapping[str, str], metadata: Mapping[str, str], schema: pa.Schema) -> list[str]:
    """The top-level columns the mapped paths start in (all a reader needs to decode)."""
    heads = (_head(path, schema.names) for path in [*mapped.values(), *metadata.values()])
    return list(dict.fromkeys(head for head in heads if head is not None))


def _struct_field(array: pa.Array, name: str) -> pa.Array:
    """A struct's child with the struct's own nulls applied."""
    child = array.field(name)
    if array.null_count:
        child = pc.if_else(array.is_valid(), child, pa.nulls(len(child), child.type))
    return child


# ---------------------------------------------------------------------------------------------
# Validation by column


class _Errors:
    """Row errors of a whole dataset: the first `DatasetError.MAX_LISTED` kept, all counted."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.kept: list[RowError] = []
        self.count = 0

    def add(self, row: int, column: str, message: str) -> None:
        self.count += 1
        if len(self.kept) < DatasetError.MAX_LISTED:
            self.kept.append(RowError(self.path, row, column, message))


def _prompt_ids(array: pa.Array, column: str, first: int, errors: _Errors, vocab_size: int | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat ids, row offsets into them, per-row ok) from a list-of-integers column, checked per row."""
    kind = array.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
            or not pa.types.is_integer(kind.value_type):
        raise ColumnMappingError(f"input_ids: column {column!r} is {kind}; prompt ids need a list of integers")
    rows = len(array)
    if pa.types.is_fixed_size_list(kind):
        offsets = np.arange(rows + 1, dtype=np.int64) * kind.list_size
        values = array.flatten()
    else:
        offsets = np.asarray(array.offsets, dtype=np.int64)
        values = array.values
    ok = np.ones(rows, dtype=bool)
    if array.null_count:
        for row in np.flatnonzero(~np.asarray(array.is_valid())):
            errors.add(first + int(row), column, "prompt ids are null")
            ok[row] = False
    lengths = np.diff(offsets)
    start, end = int(offsets[0]), int(offsets[-1])
    values = values.slice(start, end - start)
    offsets = offsets - start
    flat = values.to_numpy(zero_copy_only=False) if values.null_count else values.to_numpy()
    if values.null_count:
        holes = np.flatnonzero(~np.asarray(values.is_valid()))
        for row in np.unique(np.searchsorted(offsets, holes, side="right") - 1):
            if ok[row]:
                errors.add(first + int(row), column, "a prompt id is null")
                ok[row] = False
        flat = np.nan_to_num(flat, nan=0).astype(np.int64)
    for row in np.flatnonzero(ok & (lengths == 0)):
        errors.add(first + int(row), column, "prompt ids are empty; a prompt needs at least one token")
        ok[row] = False
    for row in np.flatnonzero(ok & (lengths > request_schema.MAX_PROMPT_TOKENS)):
        errors.add(first + int(row), column, prompt_too_long(lengths[row]))
        ok[row] = False
    filled = np.flatnonzero(lengths > 0)
    if filled.size:
        lows = np.minimum.reduceat(flat, offsets[filled])
        highs = np.maximum.reduceat(flat, offsets[filled])
        limit = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)
        for index in np.flatnonzero((lows < 0) | (highs > limit)):
            row = int(filled[index])
            if not ok[row]:
                continue
            low, high = int(lows[index]), int(highs[index])
            if low < 0:
                errors.add(first + row, column, f"token id {low} is negative; token ids are >= 0")
            elif high > MAX_TOKEN_ID:
                errors.add(first + row, column, f"token id {high} is over {MAX_TOKEN_ID} (int32)")
            else:
                errors.add(first + row, column, outside_vocabulary(high, vocab_size))  # type: ignore[arg-type]
            ok[row] = False
    return flat, offsets, ok


def _values(batch: pa.RecordBatch, path: str, target: str) -> list[Any]:
    return _column(batch, path, target).to_pylist()


@dataclass(frozen=True)
class RequestColumns:
    """Validated rows of one record batch that ask the same of a worker (`DatasetRows`' columnar
    path): ids, job fields, and every prompt id in one array, `offsets` marking each row's."""

    ids: list[str]
    job_fields: list[dict[str, Any]]
    seeds: list[int | None]
    flat: np.ndarray
    offsets: np.ndarray
    shape: SamplingShape
    first: int = 0  # the dataset row of `ids[0]`

    def __len__(self) -> int:
        return len(self.ids)

    def largest_row(self) -> int:
        """The index in the block of the row holding the block's largest token id (the first such)."""
        segment = self.flat[self.offsets[0] : self.offsets[-1]]
        if not segment.size:
            return 0
        position = self.offsets[0] + int(np.argmax(segment))
        return int(np.searchsorted(self.offsets, position, side="right")) - 1

    @property
    def n(self) -> int:
        """Samples per request."""
        return self.shape.params.n

    @property
    def stand_in(self) -> ParsedRequest:
        """One request asking what each row asks, its prompt all the block's ids (for its largest one)."""
        return ParsedRequest(self.ids[0], self.flat[self.offsets[0] : self.offsets[-1]], self.job_fields[0], 0, False,
                             self.shape, self.seeds[0])

    def requests(self, start: int, end: int) -> list[ParsedRequest]:
        """Rows `start:end` as single requests."""
        return [ParsedRequest(self.ids[i], self.flat[self.offsets[i] : self.offsets[i + 1]], self.job_fields[i], 0,
                              False, self.shape, self.seeds[i]) for i in range(start, end)]


@dataclass
class DatasetRows:
    """Validates record batches of one dataset into blocks of `ParsedRequest`s (see `iter_dataset_blocks`)."""

    mapping: ColumnMapping
    mapped: dict[str, str]
    path: str
    vocab_size: int | None = None
    renderer: Callable[[Mapping[str, Any]], Any] | None = None
    errors: _Errors = field(init=False)
    rows: int = 0
    _seen: dict[str, int] = field(default_factory=dict)
    _shapes: dict[Any, SamplingShape] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.errors = _Errors(self.path)
        # The defaults but the seed, which `SamplingShape.dump` adds per row.
        defaults = {k: v for k, v in self.mapping.sampling.items() if k != "seed"}
        self._default_shape = SamplingShape(SamplingParams.model_validate(defaults))
        self._columnar = set(self.mapped) <= {"input_ids", "id", "seed"} and "input_ids" in self.mapped
        chat = "messages" in self.mapped or "prompt" in self.mapped
        if chat and self.renderer is None:
            which = "messages" if "messages" in self.mapped else "prompt"
            raise ColumnMappingError(f"{which}: column {self.mapped[which]!r} holds chat input, which needs a "
                                     "tokenizer to render it (--tokenizer PATH, or tokenizer= in Python)")

    def column_of(self, field_path: str) -> str:
        """The column a request field came from (for error messages)."""
        parts = re.sub(r"\[\d+\]", "", field_path).split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in self.mapped:
                return self.mapped[head]
            if head.startswith("sampling_params.") and head.split(".")[1] in self.mapped:
                return self.mapped[head.split(".")[1]]
            if head.startswith("metadata.") and head.split(".")[1] in self.mapping.metadata:
                return self.mapping.metadata[head.split(".")[1]]
        return field_path

    def block(self, batch: pa.RecordBatch) -> list[ParsedRequest] | RequestColumns:
        """The valid requests of one record batch (all of it checked; errors kept in `errors`)."""
        first = self.rows
        count = batch.num_rows
        self.rows += count
        if "input_ids" in self.mapped:
            ids_column = self.mapped["input_ids"]
            flat, offsets, ok = _prompt_ids(_column(batch, ids_column, "input_ids"), ids_column, first,
                                            self.errors, self.vocab_size)
        else:
            flat, offsets, ok = np.empty(0, np.int64), np.zeros(count + 1, np.int64), np.ones(count, bool)
        if self._columnar:
            columnar = self._columnar_block(batch, first, flat, offsets, ok)
            if columnar is not None:
                return columnar
        columns = {name: _values(batch, path, name) for name, path in self.mapped.items() if name != "input_ids"}
        metadata = {key: _values(batch, path, f"metadata.{key}") for key, path in self.mapping.metadata.items()}
        sampling_columns = [name for name in columns if name in _SAMPLING_NAMES]
        defaults = dict(self.mapping.sampling)
        out: list[ParsedRequest] = []
        for index in range(count):
            if not ok[index]:
                continue
            row = first + index
            line: dict[str, Any] = {}
            for name, values in columns.items():
                value = values[index]
                if name in _SAMPLING_NAMES or (value is None and name != "id"):
                    continue
                line[name] = value
            sampling = {**defaults, **(line.get("sampling_params") or {})} if defaults or "sampling_params" in line \
                else {}
            for name in sampling_columns:
                if columns[name][index] is not None:
                    sampling[name] = columns[name][index]
            if sampling:
                line["sampling_params"] = {k: v for k, v in sampling.items() if v is not None}
            if metadata:
                line["metadata"] = {key: values[index] for key, values in metadata.items()}
            if "id" not in line:
                line["id"] = str(row)
            elif type(line["id"]) is int:
                line["id"] = str(line["id"])
            request = self._request(row, line, flat[offsets[index]:offsets[index + 1]])
            if request is None:
                continue
            first_row = self._seen.setdefault(request.id, row)
            if first_row != row:
                self.errors.add(row, self.column_of("id"), f"duplicate id {request.id!r} (first in row {first_row}); "
                                "ids must be unique in a submit")
                continue
            out.append(request)
        return out

    def _columnar_block(self, batch: pa.RecordBatch, first: int, flat: np.ndarray, offsets: np.ndarray,
                        ok: np.ndarray) -> RequestColumns | None:
        """The common case checked by column, without a dict per row to validate: token ids, an id
        column (strings or integers) or the row index, a `seed` column of integers, metadata from
        columns of numbers, strings or bools, every other sampling parameter from the defaults.
        None when a column needs the per-row path (which words its errors)."""
        count = batch.num_rows
        if "id" in self.mapped:
            column = _column(batch, self.mapped["id"], "id")
            if pa.types.is_integer(column.type):
                column = pc.cast(column, pa.string())
            elif not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
                return None
            length = pc.utf8_length(column).to_numpy(zero_copy_only=False)
            if (column.null_count or int(np.nanmin(length, initial=1)) < 1
                    or int(np.nanmax(length, initial=1)) > MAX_ID_CHARS):
                return None
            idents = column.to_pylist()
        else:
            idents = [str(first + i) for i in range(count)]
        seeds: list[Any] = [self.mapping.sampling.get("seed")] * count
        if "seed" in self.mapped:
            column = _column(batch, self.mapped["seed"], "seed")
            if not pa.types.is_integer(column.type):
                return None
            values = column.to_numpy(zero_copy_only=False)
            if column.null_count or (values.size and (int(values.min()) < 0 or int(values.max()) > MAX_SEED)):
                return None
            seeds = values.tolist()
        metadata = {}
        bound = 2
        for key, path in self.mapping.metadata.items():
            column = _column(batch, path, f"metadata.{key}")
            kind = column.type
            if pa.types.is_floating(kind):
                if pc.sum(pc.invert(pc.is_finite(column))).as_py():  # NaN or infinity: not plain JSON
                    return None
                bound += 32
            elif pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_null(kind):
                bound += 24
            elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
                bound += 6 * int(pc.max(pc.binary_length(column)).as_py() or 0) + 8
            else:
                return None
            bound += 6 * len(key) + 8
            metadata[key] = column.to_pylist()
        if bound > request_schema.MAX_METADATA_BYTES:
            return None
        shape = self._default_shape
        if not self._unique(idents, first) or not ok.all():
            # nothing of a dataset with errors is enqueued: its rows need not be packed
            return RequestColumns([], [], [], flat, offsets[:1], shape)
        dump = shape.dump
        fields = [{"id": ident, "sampling_params": dump(seed)} for ident, seed in zip(idents, seeds, strict=True)]
        if fields and fields[0]["sampling_params"] is None:  # seeds are all given or none is
            for job_fields in fields:  # every sampling parameter at its default: the field is left out
                del job_fields["sampling_params"]
        if metadata:
            names = list(metadata)
            for job_fields, values in zip(fields, zip(*metadata.values(), strict=True), strict=True):
                job_fields["metadata"] = dict(zip(names, values, strict=True))
        return RequestColumns(idents, fields, seeds, flat, offsets, shape, first)

    def _unique(self, idents: list[str], first: int) -> bool:
        """Record the ids of rows `first...`; False (each duplicate noted) when one was seen before."""
        fresh = dict(zip(idents, range(first, first + len(idents)), strict=True))
        if len(fresh) == len(idents) and self._seen.keys().isdisjoint(fresh):
            self._seen.update(fresh)
            return True
        column = self.column_of("id")
        for row, ident in enumerate(idents, start=first):
            first_row = self._seen.setdefault(ident, row)
            if first_row != row:
                self.errors.add(row, column, f"duplicate id {ident!r} (first in row {first_row}); "
                                "ids must be unique in a submit")
        return False

    def _request(self, row: int, line: dict[str, Any], ids: np.ndarray) -> ParsedRequest | None:
        if self.renderer is not None and "input_ids" not in self.mapped:
            rendered = self._render(row, line)
            if rendered is None:
                return None
            line, ids = rendered
        # `fast_fields` takes the seed out of the sampling parameters it is given: a copy, so that
        # pydantic below sees the row as it is.
        given = {**line, "sampling_params": dict(line["sampling_params"])} if "sampling_params" in line else line
        try:
            return fast_fields(given, ids, request_schema.MAX_METADATA_BYTES, self._shapes)
        except (StepAside, ValueError, TypeError, RecursionError):
            pass
        try:  # pydantic decides, and words the problem
            model = RolloutRequest.model_validate({**line, "input_ids": [0]})
        except ValidationError as exc:
            for error in validation_errors(self.path, row, exc):
                column = self.column_of(error.field)
                if error.field == "metadata" and self.mapping.metadata:
                    column = self._metadata_column(line["metadata"])
                self.errors.add(row, column, f"{error.field}: {error.message}")
            return None
        return ParsedRequest.from_request(model.model_copy(update={"input_ids": ids.tolist()}))

    def _metadata_column(self, metadata: dict[str, Any]) -> str:
        """The column of the first metadata key that is not plain JSON (all of them when only the size is over)."""
        for key, path in self.mapping.metadata.items():
            try:
                request_schema.encode_metadata({key: metadata.get(key)})
            except (ValueError, TypeError, RecursionError):
                return path
        return ", ".join(self.mapping.metadata.values())

    def _render(self, row: int, line: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray] | None:
        assert self.renderer is not None
        if "messages" in line:
            line["messages"] = [_drop_nulls(m) for m in line["messages"]] if isinstance(line["messages"], list) \
                else line["messages"]
        try:
            rendered = dict(self.renderer(line))
        except ValidationError as exc:
            for error in validation_errors(self.path, row, exc):
                self.errors.add(row, self.column_of(error.field), f"{error.field}: {error.message}")
            return None
        except RenderError as exc:
            self.errors.add(row, self.column_of(exc.field), exc.message)
            return None
        if "input_ids" not in rendered:
            column = self.mapped.get("messages", self.mapped.get("prompt", ""))
            self.errors.add(row, column, "null: the row has no chat input to render")
            return None
        ids = np.asarray(rendered.pop("input_ids"), dtype=np.int64)
        limit = MAX_TOKEN_ID if self.vocab_size is None else self.vocab_size - 1
        if ids.size and int(ids.max()) > limit:
            column = self.mapped.get("messages", self.mapped.get("prompt", ""))
            self.errors.add(row, column, f"rendered token id {int(ids.max())} is outside the model's vocabulary "
                            f"of {self.vocab_size}")
            return None
        return rendered, ids


def _drop_nulls(message: Any) -> Any:
    """A message struct as Arrow gives it (every field of the column's struct, absent ones null) as a dict
    holding only what the row has."""
    return {k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message


def dataset_blocks(
    source: DatasetSource,
    mapping: ColumnMapping,
    *,
    vocab_size: int | None = None,
    renderer: Callable[[Mapping[str, Any]], Any] | None = None,
) -> Iterator[list[ParsedRequest] | RequestColumns]:
    """The valid requests of each record batch as soon as it is checked, in row order; after the last
    row, `DatasetError` listing the problems if there were any (nothing more is yielded once one is
    found: the caller is to discard what it got). A mapping problem raises `ColumnMappingError` first."""
    mapped = mapping.resolve(source.schema)
    rows = DatasetRows(mapping, mapped, source.name, vocab_size, renderer)
    # Nothing built here forms a reference cycle: the collector's passes over the growing heap of
    # job-field dicts are skipped while reading (as `pipeline.submit.request_file` does for lines).
    collecting = gc.isenabled()
    gc.disable()
    try:
        for batch in source.read(columns_needed(mapped, mapping.metadata, source.schema)):
            block = rows.block(batch)
            if block and not rows.errors.count:
                yield block
    finally:
        if collecting:
            gc.enable()
    if not rows.rows:
        raise DatasetError(source.name, [RowError(source.name, 0, "", "the dataset has no rows")], 1, 0)
    if rows.errors.count:
        raise DatasetError(source.name, rows.errors.kept, rows.errors.count, rows.rows)
