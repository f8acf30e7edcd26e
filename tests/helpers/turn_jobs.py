"""Jobs of a worker's turn queue or of the pool's shared lane (`pipeline.core.jobs.turn_queue`), as
`pipeline serve` pushes them."""

from __future__ import annotations

import time

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import replies, turn_queue
from schemas.job_payload import JobPayload, TurnTag
from schemas.request import RolloutRequest
from schemas.turn_job import TurnJob

SERVER = "test-server"  # the server the items' turns are answered to


def answers(conn: redis.Redis, count: int = 1, timeout: float = 30) -> dict[str, bytes]:
    """The next `count` answers in `SERVER`'s inbox, by turn id."""
    got: dict[str, bytes] = {}
    deadline = time.monotonic() + timeout
    while len(got) < count:
        popped = conn.blpop([keys.serve_inbox(SERVER)], timeout=max(0.01, deadline - time.monotonic()))
        assert popped is not None, f"{len(got)} of {count} answers came within {timeout} s"
        turn_id, answer = replies.parse(popped[1])
        got[turn_id] = answer
    return got


def turn_job(job_id: str, *turn_ids: str, retries: int = 1, needs: dict | None = None) -> TurnJob:
    """A job of one 3-token request per turn of run `r`, session `s-<turn id>` (asking for `needs`)."""
    requests = [RolloutRequest.model_validate({"id": f"{t}:0", "input_ids": [1, 2, 3]}) for t in turn_ids]
    payload = JobPayload.pack(requests, run="r", job_id=job_id, batch_id=job_id, output="file:///tmp/out",
                              submitted_at_ms=0,
                              turns=[TurnTag(turn_id=t, session_id=f"s-{t}", turn=0, reply_to=SERVER)
                                     for t in turn_ids])
    return turn_queue.new_job(job_id, payload.as_json(), needs or {}, f"{len(turn_ids)} agent turn(s) of run r",
                                timeout_s=60, retries=retries)


def push(conn: redis.Redis, worker: str | None, job: TurnJob, pool: str | None = None) -> None:
    """Route `job` to `worker`'s turn queue (None: the pool's shared lane)."""
    with conn.pipeline(transaction=False) as pipe:
        turn_queue.push(pipe, keys.pool(pool), worker, job)
        pipe.execute()
