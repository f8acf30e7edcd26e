"""A job taken from the worker's own lane (`pipeline.core.jobs.lanes`): the lane item as an in-memory
RQ job of the project's job function, never saved, so the feeder runs it as it runs any job (its
ends are the lane's: `workers.process.own_lane.LaneBookkeeping`)."""

from __future__ import annotations

from rq.queue import Queue

from pipeline.core.jobs import lanes
from workers.jobs.allowed_job import RolloutJob


class LaneJob(RolloutJob):
    """A lane item as the RQ job the feeder runs (in memory only)."""

    item: lanes.LaneItem
    raw: bytes  # the item as it sits in the in-flight list

    @classmethod
    def of(cls, raw: bytes, queue: Queue) -> LaneJob:
        """The item `raw` as a job of `queue` (the pool's shared lane: where a rehome would put it)."""
        item = lanes.LaneItem.decode(raw)
        job = item.rq_job(queue)
        job.__class__ = cls
        job.item, job.raw = item, raw
        return job

    @property
    def ran_before(self) -> bool:
        """Whether an earlier run of it may have left a checkpoint (it was handed back or retried)."""
        return self.item.attempts > 0
