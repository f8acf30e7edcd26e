"""Reading and validating a rollouts JSONL file, every line before anything is enqueued.

Each problem is reported with its file, line number and field; one bad line rejects the
whole file, so a submit enqueues all of a file or none of it.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import simdjson
from pydantic import ValidationError

from pipeline.core.errors import LineError, PipelineError, RequestFileError
from pipeline.core.suggest import OTHER_NAMES, did_you_mean
from schemas import request as request_schema
from schemas.adapters import ADAPTER_NAME_PATTERN
from schemas.chat import CHAT_INPUTS
from schemas.request import (
    MAX_ID_CHARS,
    MAX_LINE_BYTES,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROBS,
    MAX_SEED,
    MAX_TOKEN_ID,
    RolloutRequest,
    SamplingParams,
    outside_vocabulary,
)

_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)

# Pydantic names union branches in error locations ("str", "list[int]", "constrained-int",
# "function-before[...]"); a user thinks in field names only.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\]|constrained-\w+)$")


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
    path = ""
    for part in parts:
        path += f"[{part}]" if part.isdigit() else (f".{part}" if path else part)
    return path


_TOP_FIELDS = tuple(RolloutRequest.model_fields)
_SAMPLING_FIELDS = tuple(SamplingParams.model_fields)
# Where pydantic places a chat line's input (`pipeline.submit.render` renders it, given a tokenizer).
_CHAT_LOCS = tuple((name,) for name in CHAT_INPUTS)


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """'unknown field', with the known name it most likely meant."""
    name = str(loc[-1])
    if len(loc) == 1 and (name in _SAMPLING_FIELDS or OTHER_NAMES.get(name) in _SAMPLING_FIELDS):
        return (f"unknown field: sampling parameters go inside \"sampling_params\" "
                f"({{\"sampling_params\": {{\"{OTHER_NAMES.get(name, name)}\": ...}}}})")
    hint = ""
    if len(loc) == 2 and loc[0] == "sampling_params":
        hint = did_you_mean(name, _SAMPLING_FIELDS, aliases=OTHER_NAMES)
    elif len(loc) == 1:
        hint = did_you_mean(name, _TOP_FIELDS, aliases={k: v for k, v in OTHER_NAMES.items() if v in _TOP_FIELDS})
        inside = did_you_mean(name, _SAMPLING_FIELDS)
        hint = hint or (inside[:-1] + " inside \"sampling_params\"?" if inside else "")
    return f"unknown field{hint or ' (check its spelling against the request schema)'}"


def _message(error: dict) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return _unknown_field(error["loc"])
    if kind == "missing":
        return "required field is missing"
    if kind == "json_invalid":
        # The parser counts lines and columns within the one line it was given (a line break at its end
        # is a "line 2"): name the column only; the file's line is the error's own.
        detail = re.sub(r" at line (\d+) column (\d+)",
                        lambda m: f" at column {m[2]}" if m[1] == "1" else " at the end of the line",
                        error["ctx"].get("error", "parse error"))
        return f"line is not valid JSON ({detail})"
    if kind == "model_type":
        return "line must be a JSON object"
    message = error["msg"].removeprefix("Value error, ")
    given = error.get("input")
    if kind.endswith("_type") and not isinstance(given, dict | list):
        message += f" (got {given!r})"
    return message


def validation_errors(path: str, line: int, exc: ValidationError) -> list[LineError]:
    """One located error per field (union branches collapsed)."""
    errors = exc.errors()
    chat = [e["loc"][0] for e in errors if e["type"] == "extra_forbidden" and e["loc"] in _CHAT_LOCS]
    if chat:  # a chat/prompt line reached the token-id schema: no tokenizer rendered it
        flag = "--tokenizer PATH (Python: `submit(..., tokenizer=...)`)"
        errors = [e for e in errors if e["loc"] not in (("input_ids",), *_CHAT_LOCS)]
        first = LineError(path, line, str(chat[0]), f"a {'chat' if chat[0] == 'messages' else 'prompt'} line needs "
                          f"a tokenizer to render it into input_ids: pass {flag}")
    seen: dict[str, LineError] = {first.field: first} if chat else {}
    for error in errors:
        field = _field_path(error["loc"])
        seen.setdefault(field, LineError(path, line, field, _message(error)))
    return list(seen.values())


_IDS_KEY = b'"input_ids"'
_BOM = b"\xef\xbb\xbf"
_ALL_FIELDS = frozenset(RolloutRequest.model_fields)
_DEFAULT_SAMPLING = SamplingParams()
_BLOCK = 64  # lines whose ids are range-checked together (one concatenation, two array passes)
READ_BUFFER = 1 << 20
_MAX_NESTING = 64  # brackets outside the ids beyond which the fast path steps aside
# `encode_metadata` (ensure_ascii=False, ", " and ": " separators, float repr) writes at most this
# many bytes per byte of a line without \\u escapes: "9e15" (4 bytes) becomes "9000000000000000.0".
_METADATA_GROWTH = 5


class StepAside(Exception):
    """The fast path cannot vouch for a line; pydantic's full parse decides (and words any error)."""


class SamplingShape:
    """One validated `sampling_params` shape (every field but `seed`), shared by the lines that use it."""

    __slots__ = ("after_seed", "before_seed", "include", "params", "stop_max")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.include = params != _DEFAULT_SAMPLING
        dumped = params.model_dump(exclude_defaults=True)
        at = _SAMPLING_FIELDS.index("seed")
        self.before_seed = {k: v for k, v in dumped.items() if _SAMPLING_FIELDS.index(k) < at}
        self.after_seed = {k: v for k, v in dumped.items() if _SAMPLING_FIELDS.index(k) > at}
        self.stop_max = max(params.user_stop_token_ids, default=-1)

    def dump(self, seed: int | None) -> dict[str, Any] | None:
        """`model_dump(exclude_defaults=True)` of these params with `seed`; None when all default."""
        if seed is None:
            return {**self.before_seed, **self.after_seed} if self.include else None
        return {**self.before_seed, "seed": seed, **self.after_seed}


_DEFAULT_SHAPE = SamplingShape(_DEFAULT_SAMPLING)


class ParsedRequest:
    """A validated request line with its prompt ids kept as one numpy array (no Python list per prompt).

    `job_fields` is what `RolloutRequest.model_dump(exclude={"input_ids"}, exclude_defaults=True)` gives;
    `to_request()` builds the full model where one is needed. `pipeline.submit.enqueue` packs these directly.
    """

    __slots__ = (
        "_max_id",
        "_request",
        "_seed",
        "_shape",
        "id",
        "job_fields",
        "logprobs",
        "n",
        "prompt_ids",
        "return_routed_experts",
    )

    def __init__(self, ident: str, prompt_ids: np.ndarray, job_fields: dict[str, Any], logprobs: int | None,
                 return_routed_experts: bool, shape: SamplingShape, seed: int | None,
                 request: RolloutRequest | None = None) -> None:
        self.id = ident
        self.prompt_ids = prompt_ids
        self.job_fields = job_fields
        self.logprobs = logprobs
        self.return_routed_experts = return_routed_experts
        self.n = shape.params.n
        self._shape = shape
        self._seed = seed
        self._request = request
        self._max_id: int | None = None

    @classmethod
    def from_request(cls, request: RolloutRequest) -> ParsedRequest:
        return cls._of(request, np.asarray(request.input_ids, dtype=np.int64), request)

    @classmethod
    def _of(cls, request: RolloutRequest, prompt_ids: np.ndarray, whole: RolloutRequest | None) -> ParsedRequest:
        """`request`'s fields with `prompt_ids` (`whole`: the model with those ids, when there is one)."""
        return cls(request.id, prompt_ids, request.model_dump(exclude={"input_ids"}, exclude_defaults=True),
                   request.logprobs, request.return_routed_experts, SamplingShape(request.sampling_params), None,
                   whole)

    @classmethod
    def of_array(cls, fields: dict[str, Any], prompt_ids: np.ndarray) -> ParsedRequest:
        """The request of `fields` (a line without `input_ids`) whose prompt ids are `prompt_ids`,
        checked as the model checks them but as an array: no Python int per id (`pipeline serve`'s
        turn, whose ids are a long conversation's). Ids the model would refuse are validated by it,
        for its own error."""
        if 0 < prompt_ids.size <= request_schema.MAX_PROMPT_TOKENS and int(prompt_ids.min()) >= 0 \
                and int(prompt_ids.max()) <= request_schema.MAX_TOKEN_ID:
            request = RolloutRequest.model_validate({**fields, "input_ids": [0]})
        else:
            request = RolloutRequest.model_validate({**fields, "input_ids": prompt_ids.tolist()})
        return cls._of(request, prompt_ids, None)

    @property
    def adapter(self) -> str | None:
        return self.job_fields.get("adapter")

    @property
    def sampling_params(self) -> SamplingParams:
        params = self._shape.params
        return params if self._seed is None else params.model_copy(update={"seed": self._seed})

    @property
    def sampling_shape(self) -> SamplingParams:
        """The sampling parameters without the seed (no copy per line), as the capability rules read them."""
        return self._shape.params

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids.tolist()

    @property
    def prompt_logprobs(self) -> int | None:
        return self.job_fields.get("prompt_logprobs")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._shape.params.stop_strings

    def max_token_id(self) -> int:
        """The largest token id the request names (prompt and token-id stops)."""
        if self._max_id is None:
            self._max_id = max(int(self.prompt_ids.max()), self._shape.stop_max)
        return self._max_id

    def to_request(self) -> RolloutRequest:
        if self._request is None:
            # The ids were checked as an array: the model takes them without a second pass.
            request = RolloutRequest.model_validate({**self.job_fields, "input_ids": [0]})
            self._request = request.model_copy(update={"input_ids": self.prompt_ids.tolist()})
        return self._request


def fast_fields(line: dict[str, Any], ids: np.ndarray, size: int, shapes: dict[Any, SamplingShape]) -> ParsedRequest:
    """Every field but the ids (`size` bytes of the line), checked as the model would; `StepAside`
    for anything the model might see differently (pydantic then decides)."""
    ident = line.get("id")
    if type(ident) is not str or not 0 < len(ident) <= MAX_ID_CHARS:
        raise StepAside
    fields: dict[str, Any] = {"id": ident}
    seed = None
    shape = _DEFAULT_SHAPE
    if "sampling_params" in line:
        given = line["sampling_params"]
        if type(given) is not dict:
            raise StepAside
        if "seed" in given:
            seed = given.pop("seed")
            if seed is not None and (type(seed) is not int or not 0 <= seed <= MAX_SEED):
                raise StepAside
        try:
            key: Any = (tuple(given.items()), tuple(map(type, given.values())))
            shape = shapes.get(key)  # type: ignore[assignment]
        except TypeError:  # list values (stops): validated each time
            key, shape = None, None  # type: ignore[assignment]
        if shape is None:
            try:
                shape = SamplingShape(SamplingParams.model_validate(given))
            except ValidationError:
                raise StepAside from None
            if key is not None:
                shapes[key] = shape
        dumped = shape.dump(seed)
        if dumped is not None:
            fields["sampling_params"] = dumped
    logprobs = line.get("logprobs", 0)
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_LOGPROBS):
        raise StepAside
    if logprobs != 0:
        fields["logprobs"] = logprobs
    prompt_logprobs = line.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if type(prompt_logprobs) is not int or not 0 <= prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise StepAside
        fields["prompt_logprobs"] = prompt_logprobs
    routed = line.get("return_routed_experts", False)
    if type(routed) is not bool:
        raise StepAside
    if routed:
        fields["return_routed_experts"] = True
    if "metadata" in line:
        metadata = line["metadata"]
        if type(metadata) is not dict:
            raise StepAside
        if metadata:
            # Encoding the metadata (to measure it) is needed only when it could be over the limit:
            # the encoder writes at most _METADATA_GROWTH bytes per byte of the line.
            if size * _METADATA_GROWTH > request_schema.MAX_METADATA_BYTES:
                try:
                    encoded = len(request_schema.encode_metadata(metadata))
                except (ValueError, RecursionError):
                    raise StepAside from None
                if encoded > request_schema.MAX_METADATA_BYTES:
                    raise StepAside
            fields["metadata"] = metadata
    if "routing_key" in line:  # rare in files: the model checks it
        raise StepAside
    adapter = line.get("adapter")
    if adapter is not None:
        if type(adapter) is not str or not _ADAPTER_NAME.match(adapter):
            raise StepAside
        fields["adapter"] = adapter
    prompt_text = line.get("prompt_text")
    if prompt_text is not None:
        if type(prompt_text) is not str:
            raise StepAside
        fields["prompt_text"] = prompt_text
    return ParsedRequest(ident, ids, fields, logprobs, routed, shape, seed)


def _ids_span(raw: bytes) -> tuple[int, int] | None:
    """Where the line's `"input_ids"` array opens and closes, when it holds no array inside it and
    the key is the only one of its name; None otherwise.

    simdjson's `as_buffer` flattens nested arrays (`[1, [2]]` reads as `[1, 2]`), so nesting is
    ruled out on the text. Without `\\u` escapes the real key is spelled literally. If the first
    occurrence were a nested look-alike, its array closes before the real (top-level) key, which
    then shows after the first ']': so one search of the tail proves the first is the key.
    """
    at = raw.find(_IDS_KEY)
    if at < 0:
        return None
    opening = raw.find(b"[", at)
    closing = raw.find(b"]", opening)
    if (opening < 0 or closing < 0 or raw[at + len(_IDS_KEY) : opening].strip() != b":"
            or raw.find(b"[", opening + 1, closing) >= 0 or raw.find(_IDS_KEY, closing) >= 0):
        return None
    return opening, closing


def _nesting(raw: bytes, opening: int, closing: int) -> int:
    """Brackets outside the ids: more than `_MAX_NESTING` and pydantic's recursion limit may apply."""
    return (raw.count(b"{", 0, opening) + raw.count(b"{", closing) + raw.count(b"[", 0, opening)
            + raw.count(b"[", closing))


def _parse_line(parser: simdjson.Parser, raw: bytes) -> tuple[dict[str, Any], np.ndarray, int] | None:
    """A common line parsed by simdjson (compiled, SIMD): the small fields as Python values, the
    ids as one int64 array read straight from the parse (not yet range checked) and the bytes the
    small fields take; None for anything unusual: not strict JSON, a BOM, `\\u` escapes, deep
    nesting, duplicate or unknown keys, ids that are not a flat list of integers."""
    if raw.startswith(_BOM) or (b"\\" in raw and b"\\u" in raw):
        return None
    span = _ids_span(raw)
    if span is None or _nesting(raw, *span) > _MAX_NESTING:
        return None
    try:
        doc = parser.parse(raw)
    except (ValueError, RuntimeError):  # not JSON by the standard (NaN, 1e400, trailing text, bad UTF-8,
        return None  # integers beyond 64 bits, ...)
    try:
        if type(doc) is not simdjson.Object:
            return None
        names = list(doc.keys())
        if len(set(names)) != len(names) or not _ALL_FIELDS.issuperset(names):
            return None
        line: dict[str, Any] = {}
        ids = None
        for name in names:
            value = doc[name]
            if name == "input_ids":
                if type(value) is not simdjson.Array:
                    return None
                # TypeError: an element is not an integer; ValueError: one beyond int64.
                ids = np.frombuffer(value.as_buffer(of_type="i"), dtype=np.int64)
            elif type(value) is simdjson.Object:
                line[name] = value.as_dict()
            elif type(value) is simdjson.Array:
                line[name] = value.as_list()
            else:
                line[name] = value
            del value  # the parser is reused only once no proxy into its document is left
        if ids is None or not 0 < ids.size <= request_schema.MAX_PROMPT_TOKENS:
            return None
        return line, ids, len(raw) - (span[1] - span[0])
    except (TypeError, ValueError):
        return None
    finally:
        del doc


def _fast_block(raws: list[bytes], shapes: dict[Any, SamplingShape],
                defaults: SamplingDefaults | None = None) -> list[ParsedRequest | None]:
    """The common lines of a block validated quickly (with `defaults`' sampling parameters added);
    None where pydantic's full path must decide.

    Each line is parsed by simdjson (which holds JSON's number grammar: no leading zeros, no '+');
    the ids of the whole block are then range-checked at once.
    """
    out: list[ParsedRequest | None] = [None] * len(raws)
    parser = simdjson.Parser()
    parsed: list[tuple[int, dict[str, Any], np.ndarray, int]] = []
    for index, raw in enumerate(raws):
        got = _parse_line(parser, raw)
        if got is not None:
            if defaults is not None:
                defaults.merge(got[0])
            parsed.append((index, *got))
    if not parsed:
        return out
    good = _ids_in_range([p[2] for p in parsed])
    for (index, line, ids, size), ok in zip(parsed, good, strict=True):
        if ok:
            with contextlib.suppress(StepAside, ValueError, RecursionError):
                out[index] = fast_fields(line, ids, size, shapes)
    return out


def _ids_in_range(arrays: list[np.ndarray]) -> list[bool]:
    flat = np.concatenate(arrays)
    if int(flat.min()) >= 0 and int(flat.max()) <= MAX_TOKEN_ID:
        return [True] * len(arrays)
    return [int(a.min()) >= 0 and int(a.max()) <= MAX_TOKEN_ID for a in arrays]


def _fast_parse(raw: bytes) -> ParsedRequest | None:
    """One line through the fast path (None: pydantic's full parse decides)."""
    return _fast_block([raw], {})[0]


def _line_errors(path: str, number: int, raw: str | bytes,
                 renderer: Callable[[str | bytes], str | bytes | dict] | None) -> tuple[list[LineError], bytes]:
    """The checks before parsing (size, rendering); errors, or the line as bytes."""
    if len(raw) > MAX_LINE_BYTES:  # characters for str input: at most the byte count
        return [LineError(path, number, "", f"line is {len(raw)} bytes, over the limit of "
                          f"{MAX_LINE_BYTES} (PIPELINE_MAX_LINE_BYTES); split the request")], b""
    if renderer is not None:
        try:
            rendered = renderer(raw)
        except ValidationError as exc:
            return validation_errors(path, number, exc), b""
        except PipelineError as exc:  # pipeline.submit.render.RenderError, located by field
            return [LineError(path, number, getattr(exc, "field", ""), getattr(exc, "message", str(exc)))], b""
        raw = json.dumps(rendered) if isinstance(rendered, dict) else rendered
    return [], raw if isinstance(raw, bytes) else raw.encode()


LineHook = Callable[[str | bytes], str | bytes | dict]


class SamplingDefaults:
    """A line hook giving each line the sampling parameters `sampling` (`pipeline submit FILE.jsonl
    --temperature T --n N ...`) where its own `sampling_params` does not set them; after `then`
    (the chat renderer) when given. Defaults that are no valid sampling parameters raise
    `PipelineError` naming each. The parser knows this hook: the lines it reads quickly get the
    defaults while they are parsed (no second JSON round trip); the others through `__call__`."""

    def __init__(self, sampling: Mapping[str, Any], then: LineHook | None = None) -> None:
        try:
            SamplingParams.model_validate(dict(sampling))
        except ValidationError as exc:
            problems = "; ".join(f"{e.field}: {e.message}" for e in validation_errors("", 0, exc))
            raise PipelineError(f"default sampling parameters: {problems}") from None
        self.sampling = dict(sampling)
        self.then = then

    def merge(self, line: dict[str, Any]) -> None:
        """Add the defaults to a parsed line whose `sampling_params` is an object (or absent)."""
        given = line.get("sampling_params", {})
        if type(given) is dict:
            line["sampling_params"] = {**self.sampling, **given}

    def __call__(self, raw: str | bytes) -> str | bytes | dict:
        """The line rendered by `then`, with the defaults (`apply`)."""
        return self.apply(self.then(raw) if self.then is not None else raw)

    def apply(self, text: str | bytes | dict) -> str | bytes | dict:
        """The line with the defaults; a line that is no JSON object is left for the parse to report."""
        try:
            line = text if isinstance(text, dict) else json.loads(text)
        except ValueError:
            return text
        if not isinstance(line, dict):
            return text
        self.merge(line)
        return line


def with_sampling_defaults(sampling: Mapping[str, Any], then: LineHook | None = None) -> SamplingDefaults:
    """The line hook of `SamplingDefaults` (pass it where a renderer goes)."""
    return SamplingDefaults(sampling, then)


def parse_request_lines(
    lines: Iterable[str | bytes], *, path: str = "<input>", vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> list[ParsedRequest]:
    """Validate every line; raise `RequestFileError` listing every problem, else return all, each
    with its prompt ids as a numpy array (`pipeline.submit.enqueue.submit_requests` packs them directly).

    `renderer` (`pipeline.submit.render.ChatRenderer.render_line`) turns chat/prompt lines into token-id lines first.
    """
    blocks = iter_request_blocks(lines, path=path, vocab_size=vocab_size, renderer=renderer)
    return [request for block in blocks for request in block]


def iter_request_blocks(
    lines: Iterable[str | bytes], *, path: str = "<input>", vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> Iterator[list[ParsedRequest]]:
    """The valid requests of every `_BLOCK` lines as soon as they are checked, in file order;
    after the last line, `RequestFileError` listing every problem if there was any (nothing more
    is yielded once a problem is found: the caller is to discard what it got).
    """
    # Nothing parsed here forms a reference cycle: the collector's passes over a growing heap of
    # small objects (a quarter of the parse time) are skipped while parsing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield from _request_blocks(lines, path, vocab_size, renderer)
    finally:
        if collecting:
            gc.enable()


def _request_blocks(
    lines: Iterable[str | bytes], path: str, vocab_size: int | None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None,
) -> Iterator[list[ParsedRequest]]:
    errors: list[LineError] = []
    first_line_of: dict[str, int] = {}
    shapes: dict[Any, SamplingShape] = {}
    defaults = renderer if isinstance(renderer, SamplingDefaults) else None
    if defaults is not None:  # merged while parsing; the renderer it wraps, if any, runs first
        renderer = defaults.then
    fast_lines = renderer is None
    total = 0
    numbered = enumerate(lines, start=1)
    while True:
        block = list(itertools.islice(numbered, _BLOCK))
        if not block:
            break
        total = block[-1][0]
        checked = [
            (number, [], raw) if fast_lines and type(raw) is bytes and len(raw) <= MAX_LINE_BYTES
            else (number, *_line_errors(path, number, raw, renderer))
            for number, raw in block if raw and not raw.isspace()
        ]
        fast = _fast_block([raw for _, found, raw in checked if not found], shapes, defaults)
        fast_of = iter(fast)
        requests: list[ParsedRequest] = []
        for number, found, raw in checked:
            if found:
                errors.extend(found)
                continue
            request = next(fast_of)
            if request is None:
                try:
                    with_defaults = raw if defaults is None else defaults.apply(raw)  # rendered already
                    if isinstance(with_defaults, dict):  # JSON again: the same (strict JSON-mode) validation
                        with_defaults = json.dumps(with_defaults)
                    request = ParsedRequest.from_request(RolloutRequest.model_validate_json(with_defaults))
                except ValidationError as exc:
                    errors.extend(validation_errors(path, number, exc))
                    continue
            if request.id in first_line_of:
                errors.append(
                    LineError(path, number, "id", f"duplicate id {request.id!r} (first on line "
                              f"{first_line_of[request.id]}); ids must be unique in a file")
                )
                continue
            first_line_of[request.id] = number
            if vocab_size is not None and request.max_token_id() >= vocab_size:
                errors.append(
                    LineError(path, number, "input_ids", outside_vocabulary(request.max_token_id(), vocab_size))
                )
                continue
            requests.append(request)
        if requests and not errors:
            yield requests
    if not first_line_of and not errors:
        errors.append(LineError(path, max(total, 1), "", "file holds no requests (one JSON object per line)"))
    if errors:
        raise RequestFileError(path, errors, total)


def parse_lines(
    lines: Iterable[str | bytes], *, path: str = "<input>", vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> list[RolloutRequest]:
    """Validate every line; raise `RequestFileError` listing every problem, else return all as models."""
    parsed = parse_request_lines(lines, path=path, vocab_size=vocab_size, renderer=renderer)
    return [request.to_request() for request in parsed]


def open_lines(path: str | Path) -> BinaryIO:
    """A JSONL file opened to be read line by line, through a buffer of `READ_BUFFER` bytes: with
    the default (the file system's block, 4-8 KiB) reading lines of a few KB took 3x as long."""
    return open(path, "rb", buffering=READ_BUFFER)


def read_request_lines(
    path: str | Path, *, vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> list[ParsedRequest]:
    """Read a JSONL file of request lines, prompt ids kept as arrays; all valid, or `RequestFileError`."""
    with open_lines(path) as handle:
        return parse_request_lines(handle, path=str(path), vocab_size=vocab_size, renderer=renderer)
