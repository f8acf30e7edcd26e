"""Why a turn failed for good, as its worker tells its server: a code and the reason in words.

The code is what the server acts on (`pipeline.serve.turn_wait` maps it to an HTTP status, the one
place that knows HTTP); the reason is for the caller to read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

FailureCode = Literal["unservable", "failed"]

# The errors that mean no worker of the pool can serve the call (the call's fault, not the worker's):
# `workers.errors.UnsupportedRequestError`, the refusals of admission, a job not allowed.
UNSERVABLE_ERRORS = frozenset({"UnsupportedRequestError", "UnservableJobError", "NotAllowedJobError"})

_PREFIX = b'{"error"'  # an encoded failure (Arrow IPC, a turn's answer otherwise, never starts so)


@dataclass(frozen=True)
class TurnFailure:
    code: FailureCode
    reason: str

    @classmethod
    def of(cls, error_class: str, message: str) -> TurnFailure:
        """The failure an error of class `error_class` (its name) stands for."""
        code: FailureCode = "unservable" if error_class in UNSERVABLE_ERRORS else "failed"
        return cls(code, f"{error_class}: {message}")

    def encode(self) -> bytes:
        return json.dumps({"error": self.reason, "code": self.code}).encode()

    @classmethod
    def decode(cls, reply: bytes) -> TurnFailure | None:
        """The failure a turn's answer holds, or None when the answer is its rows."""
        if not reply.startswith(_PREFIX):
            return None
        error = json.loads(reply)
        code = error.get("code")
        return cls(code if code in ("unservable", "failed") else "failed", str(error["error"]))
