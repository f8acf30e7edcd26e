"""Items of a worker's own lane (`pipeline.core.jobs.lanes`), as `pipeline serve` pushes them."""

from __future__ import annotations

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import lanes
from pipeline.core.jobs.queue import job_args
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest


def item(job_id: str, *turn_ids: str, retries: int = 1) -> lanes.LaneItem:
    """A lane job of one 3-token request per turn of run `r`, session `s-<turn id>`."""
    requests = [RolloutRequest.model_validate({"id": f"{t}:0", "input_ids": [1, 2, 3]}) for t in turn_ids]
    payload = JobPayload.pack(requests, run="r", job_id=job_id, batch_id=job_id, output="file:///tmp/out",
                              submitted_at_ms=0,
                              turns=[TurnTag(turn_id=t, session_id=f"s-{t}", turn=0) for t in turn_ids])
    return lanes.new_item(job_id, job_args(payload), {}, f"{len(turn_ids)} agent turn(s) of run r",
                          timeout_s=60, retries=retries)


def push(conn: redis.Redis, worker: str, lane_item: lanes.LaneItem, pool: str | None = None) -> None:
    """Route `lane_item` to `worker`'s own lane."""
    with conn.pipeline(transaction=False) as pipe:
        lanes.push(pipe, keys.pool(pool), worker, lane_item)
        pipe.execute()
