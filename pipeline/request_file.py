"""Reading and validating a rollouts JSONL file, every line before anything is enqueued.

Each problem is reported with its file, line number and field; one bad line rejects the
whole file, so a submit enqueues all of a file or none of it.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from pipeline.errors import LineError, PipelineError, RequestFileError
from schemas import request as request_schema
from schemas.request import MAX_LINE_BYTES, MAX_TOKEN_ID, RolloutRequest

# Pydantic names union branches in error locations ("str", "list[int]", "constrained-int",
# "function-before[...]"); a user thinks in field names only.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\]|constrained-\w+)$")


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts = [str(p) for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
    path = ""
    for part in parts:
        path += f"[{part}]" if part.isdigit() else (f".{part}" if path else part)
    return path


def _message(error: dict) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field (check its spelling against the request schema)"
    if kind == "missing":
        return "required field is missing"
    if kind == "json_invalid":
        return f"line is not valid JSON ({error['ctx'].get('error', 'parse error')})"
    if kind == "model_type":
        return "line must be a JSON object"
    message = error["msg"].removeprefix("Value error, ")
    given = error.get("input")
    if kind.endswith("_type") and not isinstance(given, dict | list):
        message += f" (got {given!r})"
    return message


def validation_errors(path: str, line: int, exc: ValidationError) -> list[LineError]:
    """One located error per field (union branches collapsed)."""
    seen: dict[str, LineError] = {}
    for error in exc.errors():
        field = _field_path(error["loc"])
        seen.setdefault(field, LineError(path, line, field, _message(error)))
    return list(seen.values())


_IDS_KEY = b'"input_ids"'
_ID_TEXT = b"0123456789, "


def _fast_parse(raw: bytes) -> RolloutRequest | None:
    """The common line, validated quickly; None for anything unusual (the caller then takes
    pydantic's full path, which words every error with its field).

    The prompt ids (most of a line) are parsed as one array with numpy and checked as JSON
    integers in range; every other field goes through the same strict model, with the ids
    replaced by a placeholder.
    """
    at = raw.find(_IDS_KEY)
    if at < 0 or raw.find(_IDS_KEY, at + 1) >= 0:
        return None
    opening = raw.find(b"[", at)
    closing = raw.find(b"]", opening)
    if opening < 0 or closing < 0 or raw[at + len(_IDS_KEY) : opening].strip() != b":":
        return None
    span = raw[opening + 1 : closing]
    if span.translate(None, _ID_TEXT):
        return None
    commas = span.count(b",")
    try:
        with warnings.catch_warnings():  # numpy warns (later: raises) on text it cannot read to its end
            warnings.simplefilter("error", DeprecationWarning)
            ids = np.fromstring(span, dtype=np.int64, sep=",")  # whitespace around commas is skipped
    except (ValueError, DeprecationWarning):
        return None
    if (ids.size != commas + 1 or ids.size > request_schema.MAX_PROMPT_TOKENS or int(ids.min()) < 0
            or int(ids.max()) > MAX_TOKEN_ID):
        return None
    # Every digit accounted for: no leading zeros, no overflow, no empty element, no "1 2".
    digits = np.where(ids > 0, np.floor(np.log10(np.maximum(ids, 1))) + 1, 1).sum()
    if int(digits) != len(span) - commas - span.count(b" "):
        return None
    try:
        request = RolloutRequest.model_validate_json(raw[: opening] + b"[0]" + raw[closing + 1 :])
    except ValidationError:
        return None
    return request.model_copy(update={"input_ids": ids.tolist()})


def parse_lines(
    lines: Iterable[str | bytes], *, path: str = "<input>", vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> list[RolloutRequest]:
    """Validate every line; raise `RequestFileError` listing every problem, else return all.

    `renderer` (`pipeline.chat.ChatRenderer.render_line`) turns chat/prompt lines into token-id lines first.
    """
    requests: list[RolloutRequest] = []
    errors: list[LineError] = []
    first_line_of: dict[str, int] = {}
    total = 0
    for number, raw in enumerate(lines, start=1):
        total = number
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:  # characters for str input: at most the byte count
            errors.append(LineError(path, number, "", f"line is {len(raw)} bytes, over the limit of "
                                    f"{MAX_LINE_BYTES} (PIPELINE_MAX_LINE_BYTES); split the request"))
            continue
        if renderer is not None:
            try:
                rendered = renderer(raw)
            except ValidationError as exc:
                errors.extend(validation_errors(path, number, exc))
                continue
            except PipelineError as exc:  # pipeline.chat.RenderError, located by field
                errors.append(LineError(path, number, getattr(exc, "field", ""), getattr(exc, "message", str(exc))))
                continue
            raw = json.dumps(rendered) if isinstance(rendered, dict) else rendered
        request = _fast_parse(raw if isinstance(raw, bytes) else raw.encode())
        if request is None:
            try:
                request = RolloutRequest.model_validate_json(raw)
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
                LineError(path, number, "input_ids", f"token id {request.max_token_id()} is "
                          f"outside the model's vocabulary of {vocab_size}")
            )
            continue
        requests.append(request)
    if not requests and not errors:
        errors.append(LineError(path, max(total, 1), "", "file holds no requests (one JSON object per line)"))
    if errors:
        raise RequestFileError(path, errors, total)
    return requests


def read_request_file(
    path: str | Path, *, vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
) -> list[RolloutRequest]:
    """Read a JSONL file of request lines; all valid, or `RequestFileError` and nothing."""
    with open(path, "rb") as handle:
        return parse_lines(handle, path=str(path), vocab_size=vocab_size, renderer=renderer)
