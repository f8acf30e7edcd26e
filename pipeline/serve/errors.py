"""Errors of `pipeline serve`, in OpenAI's error format: `{"error": {"message", "type", "param", "code"}}`.

Each says what was wrong and where (the field, as a dotted path) and, where the client can act,
what to do. 503 answers carry `Retry-After`; every status is one the `openai` SDK understands
(it retries 408, 409, 429 and 5xx by itself).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 500: "internal_error", 503: "service_unavailable", 504: "timeout"}


class APIError(Exception):
    """An answer other than 200: status, message, the offending field, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code or str(self.status)}}


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
