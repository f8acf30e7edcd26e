"""Pydantic validation errors as `pipeline serve` answers them: a 400 naming every bad field as a dotted path."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pipeline.serve.api_error import APIError


def location(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a dotted path: `messages.1.tool_calls.0.function`."""
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and part.startswith("function-")))


def from_validation(exc: ValidationError) -> APIError:
    """400 naming every bad field (the first one as `param`)."""
    errors = exc.errors(include_url=False)
    parts = []
    for error in errors[:8]:
        where = location(error["loc"]) or "body"
        message = "unknown field (not part of this API; check its spelling)" if error["type"] == "extra_forbidden" \
            else error["msg"]
        parts.append(f"{where}: {message}")
    more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
    return APIError(400, "; ".join(parts) + more, param=location(errors[0]["loc"]) if errors else None,
                    code="invalid_request")
