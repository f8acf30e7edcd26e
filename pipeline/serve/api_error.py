"""An answer of `pipeline serve` other than 200, in OpenAI's error format: HTTP lives in `serve/` alone."""

from __future__ import annotations

from pipeline.core.errors import PipelineError

_API_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    409: "conflict_error", 413: "invalid_request_error", 500: "internal_error",
                    503: "service_unavailable", 504: "timeout"}


class APIError(PipelineError):
    """An answer of `pipeline serve` other than 200: its status, message, the offending field (a
    dotted path), a code, extra headers (`Retry-After` on 503). `body()` is OpenAI's error format,
    `{"error": {"message", "type", "param", "code"}}`, which the `openai` SDK turns into its own
    exceptions (and retries on 408, 409, 429 and 5xx by itself)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": _API_ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code or str(self.status)}}
