"""Jobs run only where they can be served: the check a worker makes on each job it takes, batch
job or job of agent turns, before anything runs (the rules: `schemas.capabilities`); the one check
of what a job needs on the worker's side.

Submit stores what a job needs in its RQ meta (`needs`). A worker that lacks some of it, or
that refused the job before (`refused_by`: an `UnsupportedRequestError` from its engine, a
deterministic refusal), hands the job back to the end of the queue at once: no retry spent,
nothing run. Which worker serves it instead is up to the queue; this one passes over it.
When no live worker of the pool can serve the job, it waits at most
`$PIPELINE_UNSERVABLE_WAIT_S` (default 60 s; a worker that can may be starting) from the
first time a worker found it so, listed in the pool's `unservable` hash for `pipeline
status`; then it fails with that reason, without retries.

A job of agent turns (`pipeline.core.jobs.turn_queue`) that its reader cannot serve is moved to a
live worker that can (`admit_turn`), or, with none, handed back to wait for one as long, then
failed for its server with the code `unservable`.

Chosen over capability sub-queues: one queue per pool keeps FIFO order, the queue counts,
pause and RQ's registries as they are, and a mismatch costs one extra dequeue only when the
pool is mixed and the wrong worker is first.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Literal

import redis
from rq import Queue
from rq.job import Job
from rq.worker import BaseWorker

from pipeline.core import settings
from pipeline.core.broker import keys, registry
from schemas.capabilities import Needs, explain, missing
from schemas.turn_job import TurnJob
from schemas.worker_info import Capabilities
from workers.jobs.allowed_job import is_job_function, not_allowed

log = logging.getLogger(__name__)

NEEDS_META = "needs"
REFUSED_BY_META = "refused_by"
REFUSAL_META = "refusal"
UNSERVABLE_SINCE_META = "unservable_since"
ENV_UNSERVABLE_WAIT_S = settings.UNSERVABLE_WAIT_S.name


def unservable_wait_s() -> float:
    """How long a job no live worker can serve waits for one before it fails."""
    return settings.unservable_wait_s()


@dataclass(frozen=True)
class Verdict:
    """What a worker does with a job it took: run it, hand it back, move it to `to` (a job of turns),
    or fail it (nothing ran)."""

    action: Literal["run", "hand_back", "move", "fail"]
    reason: str = ""
    to: str | None = None


def job_needs(job: Job) -> Needs | None:
    """What the job needs of its worker (`pipeline submit` writes it with every job), or None when
    its meta holds no readable needs: such a job is failed, never run unchecked."""
    try:
        return Needs.from_dict(job.meta[NEEDS_META])
    except (KeyError, ValueError) as exc:
        log.warning("job %s: no readable needs in its meta (%s)", job.id, exc)
        return None


def refused_by(job: Job) -> list[str]:
    value = job.meta.get(REFUSED_BY_META)
    return [w for w in value if isinstance(w, str)] if isinstance(value, list) else []


def can_serve(needs: Needs, capabilities: Capabilities) -> bool:
    return not missing(needs, capabilities)


def decide(conn: redis.Redis, job: Job, worker_id: str, capabilities: Capabilities, pool: str) -> Verdict:
    """Whether `worker_id` (with `capabilities`, in `pool`) runs the dequeued `job`."""
    if not is_job_function(job.func_name):
        return Verdict("fail", not_allowed(job))
    needs = job_needs(job)
    if needs is None:
        return Verdict("fail", f"job {job.id} says nothing of what it needs of a worker (its meta has no "
                               f"{NEEDS_META!r}): it was not enqueued by `pipeline submit`; submit its requests again")
    refusers = refused_by(job)
    lacks = missing(needs, capabilities)
    if not lacks and worker_id not in refusers:
        if UNSERVABLE_SINCE_META in job.meta:
            _clear_unservable(conn, job, pool)
        return Verdict("run")
    mine = f"lacks {', '.join(lacks)}" if lacks else "refused it before"
    others = _able_others(conn, pool, worker_id, needs, refusers)
    if others:
        if UNSERVABLE_SINCE_META in job.meta:
            _clear_unservable(conn, job, pool)
        return Verdict("hand_back", f"worker {worker_id} {mine}; {len(others)} other live worker(s) can serve it")
    reason = _nobody(job, pool, lacks, needs, refusers)
    since = job.meta.get(UNSERVABLE_SINCE_META)
    now = time.time()
    if not isinstance(since, int | float):
        since = now
        job.meta[UNSERVABLE_SINCE_META] = since
        job.save_meta()
        conn.hset(keys.pool(pool).unservable, job.id, json.dumps({"since": since, "reason": reason}))
    if now - since >= unservable_wait_s():
        return Verdict("fail", f"{reason}; waited {now - since:.0f} s for one (${ENV_UNSERVABLE_WAIT_S})")
    return Verdict("hand_back", reason)


def admit_turn(conn: redis.Redis, job: TurnJob, worker_id: str, capabilities: Capabilities, pool: str) -> Verdict:
    """Whether `worker_id` runs the job of turns it read: run it; move it to a live worker that can
    serve it; hand it back while none can (a worker that can may be starting), for at most the
    unservable wait from its enqueue; then fail it."""
    needs = Needs.from_dict(job.needs)
    lacks = missing(needs, capabilities)
    if not lacks:
        return Verdict("run")
    others = _able_others(conn, pool, worker_id, needs, [])
    if others:
        return Verdict("move", f"worker {worker_id} lacks {', '.join(lacks)}", to=random.choice(others))
    reason = f"job {job.job_id}: no live worker of pool {pool!r} can serve it: it needs {explain(lacks, needs)}"
    waited = time.time() - job.enqueued_at
    if waited >= unservable_wait_s():
        return Verdict("fail", f"{reason}; waited {waited:.0f} s for one (${ENV_UNSERVABLE_WAIT_S})")
    return Verdict("hand_back", reason)


def _able_others(conn: redis.Redis, pool: str, worker_id: str, needs: Needs, refusers: list[str]) -> list[str]:
    """The pool's other live workers that can serve `needs` and did not refuse the job."""
    return [w.worker_id for w in registry.live_workers(conn, pool)
            if w.worker_id != worker_id and w.worker_id not in refusers and can_serve(needs, w.capabilities)]


def _nobody(job: Job, pool: str, lacks: list[str], needs: Needs, refusers: list[str]) -> str:
    reason = f"job {job.id}: no live worker of pool {pool!r} can serve it"
    if lacks:
        reason += f": it needs {explain(lacks, needs)}"
    if refusers:
        reason += f"; refused by {', '.join(refusers)}"
        if job.meta.get(REFUSAL_META):
            reason += f" ({job.meta[REFUSAL_META]})"
    return reason


def _clear_unservable(conn: redis.Redis, job: Job, pool: str) -> None:
    job.meta.pop(UNSERVABLE_SINCE_META, None)
    job.save_meta()
    conn.hdel(keys.pool(pool).unservable, job.id)


def note_refusal(job: Job, worker_id: str, reason: str) -> None:
    """Remember that `worker_id` refused `job` deterministically (`UnsupportedRequestError`): it is
    never run there again. Saved with the job's next save (the hand-back's or the failure's)."""
    refusers = refused_by(job)
    if worker_id not in refusers:
        job.meta[REFUSED_BY_META] = [*refusers, worker_id]
    job.meta[REFUSAL_META] = reason[:500]


def fail(worker: BaseWorker, job: Job, queue: Queue, pool: str, reason: str) -> None:
    """Fail a dequeued job that never started, without retries (nothing ran; retrying cannot help)."""
    job.retries_left = 0
    worker.handle_job_failure(job, queue, exc_string=f"UnservableJobError: {reason}")
    queue.intermediate_queue.remove(job.id)
    worker.connection.hdel(keys.pool(pool).unservable, job.id)
