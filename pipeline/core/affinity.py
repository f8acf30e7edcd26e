"""Where a session's next turn runs: on its home worker while that is sound, with bounded load.

A turn that lands where the session's previous turn ran finds the episode's prefix in that
engine's KV cache (turn 8 of an agent episode would otherwise prefill 7 turns again). So a
session has a home: the worker that served its last turn. The next turn goes home while the
home worker

- is alive (its registry entry has not expired),
- can serve it (its capabilities, `pipeline.submit.placement`) and serves the pool's desired
  weights (during a rolling push, a worker still on the old version is passed over when one on
  the new version can take the turn), and is not failing (`unhealthy`, `failed`),
- has room: its load (active sessions homed there, `pipeline.serve.dispatch`), this session
  included, stays within `load_factor` times the mean over the candidates, rounded up
  (consistent hashing with bounded loads, Mirrokni, Thorup and Zadeh 2018), or within `slack`
  sessions of the least-loaded candidate (so that a lightly loaded pool, where the rounded
  bound is 1 or 2, does not scatter sessions for nothing; the gateway's `prefix_hash` policy
  has an absolute threshold too). A few long sessions cannot pile onto one worker: once
  their home is full, the next turn moves.

Otherwise the turn goes to the least-loaded candidate and that becomes the session's home; for a
turn on a LoRA adapter, the least-loaded candidate holding that adapter version resident
(`prefers`: loading it elsewhere costs a read from its store, and on an HTTP engine a load on its
servers) while that one is within `slack` sessions of the least-loaded of all.
Ties (an idle pool) are broken by rendezvous hashing of the session id and the worker id, so
sessions spread evenly and every server picks alike, without hashing on the prompt (hashing a
system prompt that every session shares sends a whole dataset to one engine). Why a home moves
is counted (`new`, `gone`, `sick`, `cannot`, `weights`, `full`). A move costs one prefill of the
episode on the new worker, once.

`choose` is pure: the server's router gives it the live workers and their loads.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from schemas.worker_info import WorkerInfo

DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_SLACK = 2  # sessions above the least-loaded worker a home may hold whatever the bound
SICK = ("unhealthy", "failed")
REASONS = ("new", "gone", "sick", "cannot", "weights", "full")


@dataclass(frozen=True)
class Route:
    """A turn's worker (None: no worker can take it now; it waits in the pool's shared lane) and,
    when it is not the session's home, why the home moves."""

    worker: str | None
    moved: str | None = None


def bound(in_flight: int, candidates: int, load_factor: float) -> int:
    """The most load one worker may hold once this session is placed (`in_flight`: the candidates' load)."""
    return max(1, math.ceil(load_factor * (in_flight + 1) / max(1, candidates)))


def rank(session_id: str, worker_id: str) -> int:
    """Rendezvous hashing's weight of a worker (or server) for a key: the highest wins."""
    return int.from_bytes(hashlib.blake2b(f"{session_id}\0{worker_id}".encode(), digest_size=8).digest(), "big")


def choose(session_id: str, home: str | None, workers: Sequence[WorkerInfo], loads: Mapping[str, int], *,
           can_serve: Callable[[WorkerInfo], bool], desired_version: int | None,
           load_factor: float = DEFAULT_LOAD_FACTOR, slack: int = DEFAULT_SLACK,
           prefers: Callable[[WorkerInfo], bool] | None = None) -> Route:
    """The worker for a session's next turn (see the module doc)."""
    capable = [w for w in workers if w.state not in SICK and can_serve(w)]
    current = [w for w in capable if desired_version is None or w.weight_version == desired_version]
    candidates = current or capable
    if not candidates:
        return Route(None, None if home is None else "gone")
    ids = {w.worker_id for w in candidates}
    def least_loaded(among: Sequence[WorkerInfo]) -> WorkerInfo:
        return min(among, key=lambda w: (loads.get(w.worker_id, 0), -rank(session_id, w.worker_id)))

    target = least_loaded(candidates).worker_id
    holding = [w for w in candidates if prefers(w)] if prefers is not None else []
    if holding and loads.get(least_loaded(holding).worker_id, 0) <= loads.get(target, 0) + slack:
        target = least_loaded(holding).worker_id
    if home in ids:
        limit = max(bound(sum(loads.get(i, 0) for i in ids), len(ids), load_factor),
                    loads.get(target, 0) + slack)
        if loads.get(home, 0) + 1 <= limit:
            return Route(home)
    if home is None:
        return Route(target, "new")
    if home in ids:
        return Route(target, "full") if target != home else Route(home)
    by_id = {w.worker_id: w for w in workers}
    if home not in by_id:
        return Route(target, "gone")
    if by_id[home].state in SICK:
        return Route(target, "sick")
    return Route(target, "weights" if home in {w.worker_id for w in capable} else "cannot")
