"""The lane reserve: while the pool serves agent turns, batch jobs leave slots free for them."""

from __future__ import annotations

import fakeredis

from workers.engines.sim.engine import SimConfig, SimEngine
from workers.jobs.feeder import Feeder


class Loaded(SimEngine):
    """A sim engine whose load is set by the test."""

    now = 0

    def load(self) -> int:
        return self.now


def _feeder(engine: Loaded) -> Feeder:
    return Feeder(engine, connection=fakeredis.FakeRedis(), worker_id="w",
                  checkpoint_every_s=0)


def test_batch_jobs_leave_the_reserve_free_only_while_the_pool_serves_turns() -> None:
    engine = Loaded(SimConfig(capacity=64))
    feeder = _feeder(engine)
    assert feeder.turn_reserve == 8 and feeder.headroom == 8
    feeder._batch_job_samples = 16  # the last batch job had 16 sequences
    engine.now = 50
    assert feeder.has_room(batch=True) and feeder.has_room()  # no agent turns: up to capacity + headroom
    feeder.turns_active = lambda: True
    assert not feeder.has_room(batch=True)  # 50 + 16 would reach into the 8 reserved slots
    assert feeder.has_room()  # a turn still fits
    engine.now = 40
    assert feeder.has_room(batch=True)  # 40 + 16 = 56 = 64 - 8
    engine.now = 72
    assert not feeder.has_room()  # full for turns too
    engine.close()
