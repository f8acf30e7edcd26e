"""Reading and validating a rollouts JSONL file, every line before anything is enqueued.

Each problem is reported with its file, line number and field; one bad line rejects the
whole file, so a submit enqueues all of a file or none of it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from pipeline.errors import LineError, RequestFileError
from schemas.request import RolloutRequest

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


def parse_lines(
    lines: Iterable[str | bytes], *, path: str = "<input>", vocab_size: int | None = None
) -> list[RolloutRequest]:
    """Validate every line; raise `RequestFileError` listing every problem, else return all."""
    requests: list[RolloutRequest] = []
    errors: list[LineError] = []
    first_line_of: dict[str, int] = {}
    total = 0
    for number, raw in enumerate(lines, start=1):
        total = number
        if not raw.strip():
            continue
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


def read_request_file(path: str | Path, *, vocab_size: int | None = None) -> list[RolloutRequest]:
    """Read a JSONL file of request lines; all valid, or `RequestFileError` and nothing."""
    with open(path, "rb") as handle:
        return parse_lines(handle, path=str(path), vocab_size=vocab_size)
