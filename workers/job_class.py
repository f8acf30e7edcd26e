"""The job class workers use: it refuses any function that is not one of the project's own,
and any output URL outside the deployment's allowed schemes and prefixes (`pipeline.security`)."""

from __future__ import annotations

from typing import Any

from rq.job import Job

from pipeline.security import PolicyError, check_output_url
from workers.errors import NotAllowedJobError

ALLOWED_FUNCTIONS = frozenset({"workers.job.run_rollout_batch"})


class RolloutJob(Job):
    """An RQ job that only ever imports and calls allow-listed functions."""

    @property
    def func(self) -> Any:
        if self.func_name not in ALLOWED_FUNCTIONS:
            raise NotAllowedJobError(
                f"job {self.id} names {self.func_name!r}, which is not a rollout pipeline job "
                f"function (allowed: {sorted(ALLOWED_FUNCTIONS)}); refused, nothing ran"
            )
        payload = self.args[0] if self.args else None
        output = payload.get("output") if isinstance(payload, dict) else None
        if isinstance(output, str):
            try:
                check_output_url(output)
            except PolicyError as exc:
                raise NotAllowedJobError(f"job {self.id}: {exc}; refused, nothing ran") from exc
        return super().func
