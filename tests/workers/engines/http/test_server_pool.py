"""`ServerPool`: a routing key keeps its server while that server is up and not overloaded; no key
keeps the least-loaded choice."""

from __future__ import annotations

import math
import random
from collections import Counter

from workers.engines.http.client import ServerPool

URLS = [f"http://127.0.0.1:{port}" for port in (30001, 30002, 30003, 30004)]


def test_a_key_returns_to_its_server_and_keys_spread_over_all() -> None:
    pool = ServerPool(URLS)
    home: dict[str, str] = {}
    for turn in range(5):
        for k in range(200):
            url = pool.acquire(key=f"session-{k}")
            assert home.setdefault(f"session-{k}", url) == url, (turn, k)
            pool.release(url)
    spread = Counter(home.values())
    assert set(spread) == set(URLS)
    assert min(spread.values()) >= 25, spread  # 50 expected each


def test_a_key_moves_off_a_down_or_avoided_server_and_returns_when_it_is_up() -> None:
    pool = ServerPool(URLS)
    url = pool.acquire(key="s")
    pool.release(url)
    retry = pool.acquire(avoid=url, key="s")  # the retry of a failed call goes elsewhere
    assert retry != url
    pool.release(retry)
    pool.mark_down(url, 60.0)
    assert pool.acquire(key="s") == retry  # the key's next choice, every time while its server is down
    pool.release(retry)
    pool.mark_down(url, -1.0)  # its cool-down is over
    assert pool.acquire(key="s") == url


def test_a_hot_key_yields_once_its_server_holds_more_than_the_bound() -> None:
    pool = ServerPool(URLS[:2])
    first = pool.acquire(key="hot")
    second = pool.acquire(key="hot")
    assert first == second  # within the slack of 2 above the least loaded
    third = pool.acquire(key="hot")
    assert third != first  # 3 in flight against 0: over max(ceil(1.25 * 3 / 2), 0 + 2)
    pool.release(third)
    pool.release(second)
    assert pool.acquire(key="hot") == first  # back home once the load falls


def test_skewed_keys_never_load_a_server_past_the_bound() -> None:
    """A few hot sessions and many cold ones, calls starting and ending at random: each call lands
    where the load stays within max(ceil(1.25 x mean incl. the call), least + 2), and most land on
    their key's own server."""
    pool = ServerPool(URLS)
    rng = random.Random(7)
    keys = [f"hot-{i}" for i in range(3)] * 30 + [f"cold-{i}" for i in range(200)]
    own = {key: ServerPool(URLS).acquire(key=key) for key in set(keys)}  # each key's server in an idle pool
    open_calls: list[str] = []
    at_home = placed = 0
    for step in range(5000):
        if open_calls and rng.random() < 0.45:
            pool.release(open_calls.pop(rng.randrange(len(open_calls))))
            continue
        before = dict(pool.in_flight)
        key = rng.choice(keys)
        url = pool.acquire(key=key)
        limit = max(math.ceil(1.25 * (sum(before.values()) + 1) / len(URLS)), min(before.values()) + 2)
        assert pool.in_flight[url] <= limit, (step, before, url)
        open_calls.append(url)
        placed += 1
        at_home += url == own[key]
    assert sum(pool.in_flight.values()) > 100  # the pool was busy: the bound was tested under load
    assert at_home / placed > 0.5, (at_home, placed)


def test_without_a_key_the_least_loaded_server_takes_the_call_in_turn() -> None:
    pool = ServerPool(URLS[:2])
    held = pool.acquire()
    assert pool.acquire() != held  # the idle one
    pool.release(URLS[0])
    pool.release(URLS[1])
    served = []
    for _ in range(4):
        served.append(pool.acquire())
        pool.release(served[-1])
    assert sorted(Counter(served).values()) == [2, 2], served  # equals take turns
