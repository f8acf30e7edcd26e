"""The loaded engine of this worker process, reachable from the job function.

RQ calls the job function with only its JSON arguments; the engine was loaded once at
worker start and lives here for the life of the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.worker_info import DEFAULT_POOL
from workers.engines.base import Engine
from workers.errors import WorkerError


@dataclass
class WorkerContext:
    worker_id: str
    engine: Engine
    pool: str = DEFAULT_POOL


_current: WorkerContext | None = None


def install(context: WorkerContext) -> None:
    global _current
    _current = context


def uninstall() -> None:
    global _current
    _current = None


def current() -> WorkerContext:
    if _current is None:
        raise WorkerError("rollout jobs run only inside a `pipeline worker` process (no engine loaded)")
    return _current
