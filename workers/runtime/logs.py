"""Structured logs for `pipeline worker`: `--log-format json` (or `$PIPELINE_LOG_FORMAT=json`).

Each record becomes one JSON object on one line: `time` (UTC, ISO 8601), `level`, `logger`,
`message`, `worker`, and `job_id` and `run` on every line emitted while a job is processed
(null otherwise), plus `exc_info` when there is a traceback. The job comes from a context
variable that the worker sets around each job's work (`job_scope`), on the feeder's admitting
and completing threads; a batch that runs on an engine's own thread (`workers.engines.serial`)
runs in the context it was submitted from. Threads do not inherit context variables otherwise.

The text format (the default) gets the same fields in a bracket when a job is in hand.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from pipeline.core import settings

ENV_LOG_FORMAT = settings.LOG_FORMAT.name
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(job_tag)s"
# RQ colours parts of its messages when stdout is a terminal; JSON lines carry plain text.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class JobLogContext:
    job_id: str
    run: str | None = None
    worker_id: str | None = None


_job: contextvars.ContextVar[JobLogContext | None] = contextvars.ContextVar("pipeline_job", default=None)
_process_worker_id: str | None = None


def set_worker_id(worker_id: str | None) -> None:
    """The worker id on lines logged outside any job (one worker per process)."""
    global _process_worker_id
    _process_worker_id = worker_id


def current_job() -> JobLogContext | None:
    return _job.get()


def payload_run(payload: Any) -> str | None:
    """The run a job's payload names, or None (a foreign or malformed job)."""
    run = payload.get("run") if isinstance(payload, dict) else None
    return run if isinstance(run, str) else None


@contextlib.contextmanager
def job_scope(job_id: str, payload: Any, worker_id: str | None = None) -> Iterator[None]:
    """Every line logged in this block (on this thread) names the job and the run its payload names."""
    token = _job.set(JobLogContext(job_id=str(job_id), run=payload_run(payload), worker_id=worker_id))
    try:
        yield
    finally:
        _job.reset(token)


class JobContextFilter(logging.Filter):
    """Adds `worker_id`, `job_id`, `run` and `job_tag` (for the text format) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = _job.get()
        record.worker_id = (job.worker_id if job and job.worker_id else None) or _process_worker_id
        record.job_id = job.job_id if job else None
        record.run = job.run if job else None
        record.job_tag = f" [job={job.job_id} run={job.run}]" if job else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _ANSI.sub("", record.getMessage()),
            "worker": getattr(record, "worker_id", None),
            "job_id": getattr(record, "job_id", None),
            "run": getattr(record, "run", None),
        }
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class DemoteToDebug(logging.Filter):
    """A chatty library's INFO records become DEBUG: shown only when the root logs DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def demote_to_debug(name: str) -> None:
    """Log `name`'s INFO records at DEBUG (httpx logs every request at INFO); idempotent."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, DemoteToDebug) for f in logger.filters):
        logger.addFilter(DemoteToDebug())


def default_format() -> str:
    value = settings.log_format()
    return value if value in FORMATS else "text"


def configure(level: str | int = "INFO", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Route every logger through one root handler in `fmt`; replaces the root's handlers.

    RQ adds its own (colourised, plain text) handlers only when none is effective, so with this
    root handler its lines come out in the same format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(JobContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    if not handler.stream.isatty():
        no_progress_bars()
    return handler


def no_progress_bars() -> None:
    """Turn off Hugging Face's tqdm bars (transformers' "Loading weights" at every model load): in a
    log file or a pipe each redraw is a line of noise. Loaded already or later, transformers follows."""
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:  # the sim-only install has no Hugging Face library to quiet
        return
    disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
