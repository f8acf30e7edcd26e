"""A worker's part in session affinity: its own lane registered, dead neighbours' turns moved.

`pipeline serve` routes a session's turns to the worker that served its last one, through that
worker's own lane queue (`pipeline.core.jobs.lanes`). Every `interval_s`, this thread re-registers
the worker's lane (so a lane dropped while the worker looked dead, in a partition, comes back)
and, if no other worker of the pool did within the interval, moves the turns of the pool's dead
workers to the shared lane, so a turn routed to a worker that was killed runs again elsewhere
even when no server is waiting for it.
"""

from __future__ import annotations

import logging

import redis

from pipeline.core.broker import keys
from pipeline.core.jobs import lanes
from workers.runtime.periodic import Periodic

log = logging.getLogger(__name__)

INTERVAL_S = 10.0  # the registry notices a dead worker after three heartbeats (16 s) anyway


class LaneKeeper:
    def __init__(self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, *,
                 interval_s: float = INTERVAL_S) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.interval_s = interval_s
        self._thread = Periodic("lane-keeper", interval_s, self.tend,
                                on_error=lambda exc: log.debug("lane upkeep failed: %s", exc))  # next round

    def start(self) -> None:
        self.tend()
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def tend(self) -> None:
        lanes.register(self.conn, self.pool, self.worker_id)
        # Moving dead workers' turns is the pool's chore: one worker an interval does it.
        if not self.conn.set(self.pool.lane_rehome_claim, self.worker_id, nx=True, px=int(self.interval_s * 1000)):
            return
        moved = lanes.rehome_orphans(self.conn, self.pool)
        if moved:
            log.warning("moved %d lane job(s) of dead worker(s) of pool %r to the shared lane", moved, self.pool.name)
