"""Bounded-load affinity: a session's turn goes home while home is alive, able, current and has room."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from pipeline.core.affinity import Route, bound, choose
from schemas.worker_info import WorkerInfo


def _worker(name: str, *, version: int = 0, state: str = "idle") -> WorkerInfo:
    now = time.time()
    return WorkerInfo(worker_id=name, host="h", pid=1, engine="sim", model="m", weight_version=version,
                      state=state, started_at=now, heartbeat_at=now)  # type: ignore[arg-type]


WORKERS = [_worker(f"w{i}") for i in range(4)]


def _choose(home: str | None, loads: dict[str, int], workers: list[WorkerInfo] = WORKERS,
            desired: int | None = 0, can_serve=lambda w: True, slack: int = 0) -> Route:  # type: ignore[no-untyped-def]
    return choose("s1", home, workers, loads, can_serve=can_serve, desired_version=desired, slack=slack)


def test_a_turn_goes_home_while_home_has_room() -> None:
    assert _choose("w2", {"w2": 4, "w0": 4, "w1": 3, "w3": 3}) == Route("w2")  # bound ceil(1.25 * 15 / 4) = 5


def test_a_lightly_loaded_pool_keeps_sessions_home_within_the_slack() -> None:
    # 2 turns in flight on 4 workers: the rounded bound is 1, but w2 is within 2 turns of the least.
    moved = _choose("w2", {"w2": 1, "w0": 1})  # no slack: it would move to an idle worker
    assert moved.moved == "full" and moved.worker in {"w1", "w3"}
    assert _choose("w2", {"w2": 1, "w0": 1}, slack=2) == Route("w2")
    assert _choose("w2", {"w2": 2, "w1": 1, "w3": 1}, slack=2) == Route("w0", "full")


def test_a_new_session_goes_to_the_least_loaded_worker() -> None:
    assert _choose(None, {"w0": 2, "w1": 1, "w2": 0, "w3": 1}) == Route("w2", "new")


def test_new_sessions_on_an_idle_pool_spread_by_their_ids_alike_on_every_server() -> None:
    homes = [choose(f"s{i}", None, WORKERS, {}, can_serve=lambda w: True, desired_version=0).worker
             for i in range(400)]
    assert homes == [choose(f"s{i}", None, list(reversed(WORKERS)), {}, can_serve=lambda w: True,
                            desired_version=0).worker for i in range(400)]  # whatever order the registry lists
    assert min(Counter(homes).values()) >= 70  # about 100 each


def test_a_full_home_yields_to_the_least_loaded_worker() -> None:
    # 8 turns in flight over 4 workers: the bound is ceil(1.25 * 9 / 4) = 3; w0 already holds 3.
    assert bound(8, 4, 1.25) == 3
    assert _choose("w0", {"w0": 3, "w1": 2, "w2": 2, "w3": 1}) == Route("w3", "full")


def test_a_dead_unable_sick_or_stale_home_is_left() -> None:
    assert _choose("gone", {}).moved == "gone"
    unable = _choose("w1", {}, can_serve=lambda w: w.worker_id != "w1")
    assert unable.moved == "cannot" and unable.worker not in (None, "w1")
    sick = [_worker("w0", state="unhealthy"), _worker("w1")]
    assert _choose("w0", {}, workers=sick) == Route("w1", "sick")
    rolling = [_worker("old", version=1), _worker("new", version=2)]
    assert _choose("old", {}, workers=rolling, desired=2) == Route("new", "weights")
    # While no worker serves the desired weights yet, the home still takes the turn.
    assert _choose("old", {}, workers=[_worker("old", version=1)], desired=2) == Route("old")


def test_no_worker_that_can_serve_leaves_the_turn_to_the_shared_lane() -> None:
    assert _choose("w0", {}, can_serve=lambda w: False) == Route(None, "gone")
    assert _choose(None, {}, workers=[]) == Route(None)


@pytest.mark.parametrize("load_factor", [1.25, 1.5])
@pytest.mark.parametrize("slack", [0, 2])
def test_a_skewed_mix_keeps_every_worker_within_the_bound(load_factor: float, slack: int) -> None:
    """A few long sessions and many short ones, placed turn by turn with turns finishing at random:
    no worker ever holds more turns in flight than the bound allows."""
    rng = random.Random(7)
    workers = [_worker(f"w{i}") for i in range(8)]
    homes: dict[str, str | None] = {}
    in_flight: list[tuple[str, str]] = []  # (session, worker)
    sessions = [f"long{i}" for i in range(4)] * 40 + [f"short{i}" for i in range(200)]
    worst = 0.0
    for session in rng.sample(sessions, len(sessions)):
        loads = Counter(worker for _, worker in in_flight)
        least = min(loads.get(w.worker_id, 0) for w in workers)
        route = choose(session, homes.get(session), workers, loads, can_serve=lambda w: True, desired_version=0,
                       load_factor=load_factor, slack=slack)
        assert route.worker is not None
        loads[route.worker] += 1
        assert loads[route.worker] <= max(bound(len(in_flight), len(workers), load_factor), least + slack)
        mean = (len(in_flight) + 1) / len(workers)
        worst = max(worst, max(loads.values()) / mean) if len(in_flight) >= 2 * len(workers) else worst
        homes[session] = route.worker
        in_flight.append((session, route.worker))
        while len(in_flight) > 24:  # turns finish in random order
            in_flight.pop(rng.randrange(len(in_flight)))
    if not slack:  # the bound's rounding up: at most one turn above c x mean (3 at 24 in flight over 8)
        assert worst <= load_factor + 1 / 3


def test_a_new_session_on_an_adapter_prefers_a_worker_holding_it_within_the_slack() -> None:
    def holds(*names: str):  # type: ignore[no-untyped-def]
        return lambda w: w.worker_id in names

    loads = {"w0": 0, "w1": 2, "w2": 3, "w3": 1}
    assert choose("s1", None, WORKERS, loads, can_serve=lambda w: True, desired_version=0,
                  prefers=holds("w1", "w2")) == Route("w1", "new")  # 2 <= 0 + slack 2
    assert choose("s1", None, WORKERS, loads, can_serve=lambda w: True, desired_version=0,
                  prefers=holds("w2")) == Route("w0", "new")  # 3 > 0 + 2: the load bound first
    assert choose("s1", "w0", WORKERS, loads, can_serve=lambda w: True, desired_version=0,
                  prefers=holds("w1")) == Route("w0")  # a home with room keeps the session
