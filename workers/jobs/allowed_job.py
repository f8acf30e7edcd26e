"""The RQ job class workers use: an allow-list of job functions and output URLs.

It refuses any function that is not one of the project's own, and any output URL outside the
deployment's allowed schemes and prefixes (`pipeline.core.broker.security`).
"""

from __future__ import annotations

from typing import Any

from rq.job import Job
from rq.utils import import_attribute

from pipeline.core.broker.security import check_output_url
from pipeline.core.errors import PolicyError
from workers.errors import NotAllowedJobError

JOB_FUNCTION = "workers.jobs.batch_job.run_rollout_batch"


def is_job_function(func_name: str | None) -> bool:
    """Whether `func_name` names the project's job function."""
    return func_name == JOB_FUNCTION


def not_allowed(job: Job) -> str:
    """Why a job that names another function than the project's is refused."""
    return (f"job {job.id} names {job.func_name!r}, which is not a rollout pipeline job function "
            f"(allowed: {JOB_FUNCTION!r}); refused, nothing ran")


class RolloutJob(Job):
    """An RQ job that only ever imports and calls allow-listed functions."""

    @property
    def func(self) -> Any:
        if not is_job_function(self.func_name):
            raise NotAllowedJobError(not_allowed(self))
        payload = self.args[0] if self.args else None
        output = payload.get("output") if isinstance(payload, dict) else None
        if isinstance(output, str):
            try:
                check_output_url(output)
            except PolicyError as exc:
                raise NotAllowedJobError(f"job {self.id}: {exc}; refused, nothing ran") from exc
        return import_attribute(self.func_name)
