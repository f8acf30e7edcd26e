"""A server's turns on their way to the workers, and their answers back.

Each turn goes to a worker chosen by the router (`routing`: its session's home while that is
alive, able and not overloaded, by `pipeline.core.affinity`) through that worker's turn queue; with
no such worker it goes to the pool's shared lane (`keys.PoolKeys.lane`, the only thing called a
lane), which every live worker of the pool reads beside its own turn queue, before its batch queue,
so a turn never waits behind a 10 000-request run. Both are Redis streams of `schemas.turn_job.
TurnJob` read through one consumer group (`pipeline.core.jobs.turn_queue`): no RQ job. A job of
turns runs on the road of any batch (same allow-list, admission, retries, hand-backs, engine); its
payload carries one `TurnTag` per request, so the worker logs each turn's rows and answers its
server (`workers.jobs.turn_commits`) instead of writing a shard of one row.

Turns reaching a server together share a job (`turn_batching`); workers answer them in the
server's inbox (`inbox`); a server's waiter looks elsewhere between blocks (`turn_wait`). A failed
job fails each of its turns (after one retry).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pyarrow as pa
import redis

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, Route
from pipeline.core.broker import keys
from pipeline.core.errors import CapabilityError
from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.serve.api_error import APIError
from pipeline.serve.inbox import Inbox
from pipeline.serve.routing import Router
from pipeline.serve.turn_batching import MAX_TURNS_PER_JOB, TurnBatcher, WaitingTurn
from pipeline.serve.turn_wait import ASYNC_CONNECTIONS, DEFAULT_TURN_TIMEOUT_S, Answered, TurnWaiter
from pipeline.submit.placement import Placement
from pipeline.submit.request_file import ParsedRequest
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from schemas.worker_info import WorkerInfo

__all__ = ["ASYNC_CONNECTIONS", "DEFAULT_TURN_TIMEOUT_S", "TurnDispatch"]


class TurnDispatch:
    """One pool's turns as a server dispatches them: routing (`routing.Router`), turns batched into
    jobs (`turn_batching.TurnBatcher`), waiting for answers (`turn_wait.TurnWaiter`)."""

    def __init__(self, conn: redis.Redis, pool: str, *, turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S,
                 max_turns_per_job: int = MAX_TURNS_PER_JOB, affinity: bool = True,
                 load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        self.conn = conn
        self.keys = keys.pool(pool)
        self.router = Router(conn, self.keys, affinity=affinity, load_factor=load_factor)
        self.batcher = TurnBatcher(conn, self.router, async_conn=lambda: self.waiter.async_conn(),
                                   max_turns_per_job=max_turns_per_job)
        self.inbox = Inbox(conn)  # where workers answer this server's turns (`TurnTag.reply_to`)
        self.waiter = TurnWaiter(conn, self.router, self.inbox, self.batcher.answered, turn_timeout_s=turn_timeout_s)

    def close(self) -> None:
        """Stop taking this server's answers."""
        self.inbox.close()

    def live_workers(self) -> list[WorkerInfo]:
        return self.router.live_workers()

    async def enqueue(self, request: RolloutRequest | ParsedRequest, *, run: str, output: str, turn: TurnTag,
                      home: str | None = None) -> Route:
        """Enqueue the turn (with whatever other turns wait with it) on the worker the router chooses;
        400 when no live worker of the pool could serve what it asks. On the server's loop: the
        router's reads are fresh (`Router.fresh`), the enqueue is the flusher's."""
        await self.router.fresh()
        workers = self.router.live_workers()
        placement = Placement(workers, self.keys.name)
        needs, group = placement.place(request, request.id)
        try:
            placement.check()
        except CapabilityError as exc:
            raise APIError(400, str(exc).replace("nothing was enqueued:\n  ", ""), code="unservable") from None
        route = self.router.route(turn.session_id, home, workers, placement, group, adapter=request.adapter)
        await self.batcher.enqueue(WaitingTurn(request, turn, run, output, needs, (run, output, group, route.worker),
                                               route.worker, home))
        return route

    def stream_async(self, turn_id: str, run: str, started: float,
                     settled: Callable[[], dict[str, Any] | None]) -> AsyncIterator[list[TokenDelta] | Answered]:
        return self.waiter.stream_async(turn_id, run, started, settled)

    async def wait_async(self, turn_id: str, run: str, started: float,
                         settled: Callable[[], dict[str, Any] | None]) -> pa.Table | dict[str, Any]:
        return await self.waiter.wait_async(turn_id, run, started, settled)
