"""The upkeep thread: ticks every interval, survives a failing tick (reported), and stops."""

from __future__ import annotations

import threading

from tests.helpers.processes import wait_until
from workers.runtime.periodic import Periodic


def test_ticks_go_on_after_a_failing_one_and_stop_ends_the_thread() -> None:
    ticks: list[int] = []
    errors: list[Exception] = []
    third = threading.Event()

    def tick() -> None:
        ticks.append(len(ticks))
        if len(ticks) == 2:
            raise RuntimeError("Redis away for a moment")
        if len(ticks) == 3:
            third.set()

    periodic = Periodic("test-upkeep", 0.01, tick, on_error=errors.append)
    periodic.start()
    assert third.wait(timeout=60)  # a safety net; the third tick comes after ~30 ms
    periodic.stop()
    assert [str(e) for e in errors] == ["Redis away for a moment"]
    assert not any(t.name == "test-upkeep" for t in threading.enumerate())  # joined: no tick after stop


def test_a_stopped_one_starts_again() -> None:
    ran = threading.Event()
    periodic = Periodic("test-restart", 0.01, ran.set, on_error=lambda exc: None)
    periodic.start()
    periodic.stop()
    ran.clear()
    periodic.start()
    wait_until(ran.is_set, 60, "a tick after the restart")
    periodic.stop()
