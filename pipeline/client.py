"""The trainer's Python API: connect, submit, wait, read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
from pydantic import ValidationError

from pipeline import registry
from pipeline.batch import Batch
from pipeline.connection import connect_redis
from pipeline.errors import LineError, RequestFileError
from pipeline.request_file import read_request_file, validation_errors
from pipeline.submit import DEFAULT_BATCH_SIZE, submit_requests
from schemas.request import RolloutRequest
from schemas.worker_info import WorkerInfo


def _as_requests(requests: Sequence[RolloutRequest | Mapping[str, Any]]) -> list[RolloutRequest]:
    parsed: list[RolloutRequest] = []
    errors: list[LineError] = []
    for index, item in enumerate(requests):
        if isinstance(item, RolloutRequest):
            parsed.append(item)
            continue
        try:
            parsed.append(RolloutRequest.model_validate(item))
        except ValidationError as exc:
            errors.extend(validation_errors("<requests>", index, exc))
    if errors:
        raise RequestFileError("<requests>", errors, len(requests))
    return parsed


class Client:
    """A connection to the pipeline's Redis."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def submit(
        self,
        requests: Sequence[RolloutRequest | Mapping[str, Any]],
        *,
        run: str | None = None,
        output: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        min_weight_version: int | None = None,
    ) -> Batch:
        """Validate and enqueue requests (dicts or models); all or nothing."""
        plan = submit_requests(
            self.conn,
            _as_requests(requests),
            run=run,
            output=output,
            batch_size=batch_size,
            min_weight_version=min_weight_version,
        )
        return Batch(self.conn, plan)

    def submit_file(self, path: str, **kwargs: Any) -> Batch:
        """Validate every line of a JSONL file, then enqueue all of it."""
        return self.submit(read_request_file(path), **kwargs)

    def workers(self) -> list[WorkerInfo]:
        return registry.live_workers(self.conn)


def connect(url: str | None = None) -> Client:
    """Connect to `url`, else `$PIPELINE_REDIS_URL`, else the embedded server (started if needed)."""
    return Client(connect_redis(url))
