"""The `pipeline` package's exception hierarchy; user-facing errors say what, where and what to do."""

from __future__ import annotations

from dataclasses import dataclass


class PipelineError(Exception):
    """Base class of every error the pipeline raises on purpose."""


@dataclass(frozen=True)
class LineError:
    """One problem in a request file, located by line and field."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class RequestFileError(PipelineError):
    """A request file has invalid lines; nothing from it was enqueued."""

    def __init__(self, path: str, errors: list[LineError], total_lines: int) -> None:
        self.path = path
        self.errors = errors
        self.total_lines = total_lines
        shown = "\n".join(f"  {e}" for e in errors[:50])
        more = f"\n  ... and {len(errors) - 50} more" if len(errors) > 50 else ""
        super().__init__(
            f"{path}: {len(errors)} invalid line(s); nothing was enqueued. Fix these and submit "
            f"again:\n{shown}{more}"
        )


class EmbeddedRedisError(PipelineError):
    """The embedded Redis server could not be found or started."""


class PoolNameError(PipelineError):
    """A pool name that is not 1-64 letters, digits, '_' or '-' starting with a letter or digit."""


class CapabilityError(PipelineError):
    """No live worker can serve what the requests ask for."""


class JobsFailedError(PipelineError):
    """Some jobs of a batch failed."""

    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = failures
        lines = "\n".join(f"  {job_id}: {reason}" for job_id, reason in failures.items())
        super().__init__(f"{len(failures)} job(s) failed:\n{lines}")


class WaitTimeoutError(PipelineError):
    """A wait ran out of time before the batch finished."""
