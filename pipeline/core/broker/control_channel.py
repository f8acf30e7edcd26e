"""The control channel, trainer side: pause, resume, acknowledged weight and adapter pushes.

Each pool (`pipeline.core.broker.keys.pool`) has its own control: the desired state
(`schemas.control.DesiredState`) lives in one Redis key per pool, changed only in WATCH/MULTI
transactions that bump its generation. A PUBLISH on the pool's wake-up channel only wakes its
workers; they re-read the key, so a missed message changes nothing. Each worker acknowledges a
weight push in the pool's hash `weight_acks(version)`; `push_weights` returns when every live
worker of the pool has acknowledged, or raises naming who failed or timed out. An adapter push
names the adapter's version in the state (`announce_adapter`); each worker serving adapters
answers in the hash `adapter_acks(name)`, its newest answer per worker. Nothing here
reads or writes another pool's keys: a push or pause in one pool never touches another.

With a shared secret configured (`pipeline.core.broker.security`), the state and the acks are signed
(`schemas.control.encode`); a reader refuses unsigned or forged ones and logs them. A signed
state can still be copied: workers refuse a state older than one they followed (its
generation is signed), and each change takes a generation past every live worker's. A push
names a weight path, which must lie under the allowed prefixes when those are configured.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from pipeline.core.broker import keys, registry
from pipeline.core.broker.replication import Proof, replicated, write_until_kept
from pipeline.core.broker.security import check_weight_path, control_secret
from pipeline.core.errors import ControlAuthError, PipelineError, WeightPushError, WeightVersionError
from schemas.control import (
    SWAP_MODES,
    ControlMessageError,
    DesiredState,
    SwapMode,
    WeightAck,
    WeightSource,
    ack_purpose,
    decode,
    desired_state_purpose,
    encode,
)
from schemas.worker_info import WorkerInfo

log = logging.getLogger(__name__)

DEFAULT_PUSH_TIMEOUT_S = 600.0
_POLL_S = 0.01
# A push that finds no live worker in a pool whose previous version workers acknowledged waits this
# long for their entries: after a Redis failover the registry's entries may have gone with the old
# master, and each live worker writes its entry again at its next heartbeat (every 5 s by default).
NO_WORKERS_WAIT_S = 6.0


@dataclass
class PushResult:
    """Every live worker's acknowledgement of one push."""

    version: int
    path: str
    generation: int
    seconds: float
    acks: list[WeightAck] = field(default_factory=list)


def parse_state(raw: bytes | str | None, pool: str | None = None) -> DesiredState:
    """A pool's stored desired state, verified when a secret is configured; `ControlAuthError` if refused."""
    if raw is None:
        return DesiredState()
    try:
        return decode(raw, DesiredState, secret=control_secret(), purpose=desired_state_purpose(keys.pool_name(pool)))
    except ControlMessageError as exc:
        log.error("control state refused (%s); was it written by someone without the control secret?", exc)
        raise ControlAuthError(
            f"the stored control state is refused: {exc}; re-issue `pipeline pause`/`resume`/`weights push` "
            "from a trainer holding the control secret"
        ) from exc


def read_state(conn: redis.Redis, pool: str | None = None) -> DesiredState:
    """The pool's current desired state (the default one if never set); `ControlAuthError` if refused."""
    return parse_state(conn.get(keys.pool(pool).control_state), pool)


def encode_state(state: DesiredState, pool: str | None = None) -> str:
    return encode(state, secret=control_secret(), purpose=desired_state_purpose(keys.pool_name(pool)))


def encode_ack(ack: WeightAck, pool: str | None = None) -> str:
    return encode(ack, secret=control_secret(),
                  purpose=ack_purpose(ack.version, ack.worker, keys.pool_name(pool), ack.adapter))


def ack_key(ack: WeightAck, pool: str | None = None) -> str:
    """The hash `ack` is written to: the acks of its weight version, or its adapter's acks."""
    where = keys.pool(pool)
    return where.weight_acks(ack.version) if ack.adapter is None else where.adapter_acks(ack.adapter)


def _change(
    conn: redis.Redis,
    pool: str | None,
    update: Callable[[DesiredState], DesiredState],
    also: Callable[[redis.client.Pipeline], None] | None = None,
) -> DesiredState:
    """Apply `update` to the pool's state atomically (WATCH/MULTI), bump the generation, wait for a
    replica to have it, then wake the pool's workers. A change lost in a failover is applied again
    to the new master's state."""
    where = keys.pool(pool)
    new = write_until_kept(lambda: _apply(conn, where, update, also), lambda state: _confirm(conn, where, state),
                           f"control state change of pool {where.name!r}")
    conn.publish(where.control_channel, str(new.generation))
    return new


def _apply(
    conn: redis.Redis, where: keys.PoolKeys, update: Callable[[DesiredState], DesiredState],
    also: Callable[[redis.client.Pipeline], None] | None,
) -> DesiredState:
    """One WATCH/MULTI round of `_change`: the state written."""
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(where.control_state)
                raw = pipe.get(where.control_state)
                try:
                    current = parse_state(raw, where.name)
                except ControlAuthError:
                    # Not ours: start over from the defaults, past its generation so workers re-read.
                    current = DesiredState(generation=_claimed_generation(raw))
                changed = update(current)
                # Past every generation a live worker has followed: workers refuse older states,
                # and the stored one may be behind them (Redis lost or restored it).
                followed = max((w.control_generation for w in registry.live_workers(conn, where.name)), default=0)
                new = changed.model_copy(update={"generation": max(current.generation, followed) + 1})
                pipe.multi()
                if also is not None:
                    also(pipe)
                pipe.set(where.control_state, encode_state(new, where.name))
                pipe.sadd(keys.POOLS, where.name)
                pipe.execute()
                return new
            except redis.WatchError:
                continue


def _confirm(conn: redis.Redis, where: keys.PoolKeys, state: DesiredState) -> None:
    """Wait for a replica to have the pool's state `state` (`WriteLostError`: the master has another)."""

    def holds(raw: bytes | None) -> bool:
        try:
            return raw is not None and parse_state(raw, where.name) == state
        except ControlAuthError:
            return False

    replicated(conn, f"control state generation {state.generation} of pool {where.name!r}",
               Proof(("GET", where.control_state), holds))


def restore_state(conn: redis.Redis, raw: bytes | str, pool: str | None = None) -> bool:
    """Write back `raw`, a stored state record a worker followed, where the stored one is older: a
    Redis failover lost the newer one (workers never go back to an older generation, so Redis and
    the workers would disagree until the next change). The record is the trainer's own, verified
    by the worker (signed when a secret is set): nothing new is written. True when written back."""
    where = keys.pool(pool)
    state = parse_state(raw, where.name)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(where.control_state)
                stored = pipe.get(where.control_state)
                try:
                    generation = -1 if stored is None else parse_state(stored, where.name).generation
                except ControlAuthError:
                    generation = _claimed_generation(stored)
                if generation >= state.generation:
                    return False
                pipe.multi()
                pipe.set(where.control_state, raw)
                pipe.execute()
                break
            except redis.WatchError:
                continue
    log.warning("control state of pool %s: generation %d written back over generation %d (lost in a Redis "
                "failover?)", where.name, state.generation, generation)
    _confirm(conn, where, state)
    conn.publish(where.control_channel, str(state.generation))
    return True


def _claimed_generation(raw: bytes | str | None) -> int:
    """The generation a refused record claims, if any can be read (for continuity only)."""
    try:
        value = json.loads(raw or b"null")
        if isinstance(value, dict) and "body" in value:
            value = json.loads(value["body"])
        generation = value.get("generation") if isinstance(value, dict) else None
    except (ValueError, TypeError, AttributeError):
        return 0
    return generation if isinstance(generation, int) and 0 <= generation < 2**62 else 0


def pause(conn: redis.Redis, pool: str | None = None) -> DesiredState:
    """The pool's workers finish the batch in hand and take no new job until `resume`."""
    return _change(conn, pool, lambda s: s.model_copy(update={"paused": True}))


def resume(conn: redis.Redis, pool: str | None = None) -> DesiredState:
    return _change(conn, pool, lambda s: s.model_copy(update={"paused": False}))


def read_acks(conn: redis.Redis, version: int, pool: str | None = None) -> dict[str, WeightAck]:
    """The pool's acknowledgements of `version`; malformed, unsigned or forged ones are logged and left out."""
    where = keys.pool(pool)
    return _verified_acks(conn.hgetall(where.weight_acks(version)), where.name, None, lambda _: version)


def read_adapter_acks(conn: redis.Redis, name: str, pool: str | None = None) -> dict[str, WeightAck]:
    """Each worker's newest acknowledgement of a push of adapter `name` (its version inside); malformed,
    unsigned or forged ones are logged and left out."""
    where = keys.pool(pool)
    return _verified_acks(conn.hgetall(where.adapter_acks(name)), where.name, name, _claimed_version)


def _verified_acks(raw_acks: dict[bytes, bytes], pool: str, adapter: str | None,
                   version_of: Callable[[bytes], int]) -> dict[str, WeightAck]:
    """The acks of a hash that verify under their purpose (`version_of`: the version an ack was signed for)."""
    acks: dict[str, WeightAck] = {}
    secret = control_secret()
    what = "weights" if adapter is None else f"adapter {adapter}"
    for field_name, raw in raw_acks.items():
        worker = field_name.decode(errors="replace")
        version = version_of(raw)
        try:
            ack = decode(raw, WeightAck, secret=secret, purpose=ack_purpose(version, worker, pool, adapter))
        except ControlMessageError as exc:
            log.error("acknowledgement of %s v%d from %r refused: %s", what, version, worker, exc)
            continue
        if ack.worker != worker or ack.version != version or ack.adapter != adapter:
            log.error("acknowledgement under %r for %s v%d names worker %r, %s v%d; refused", worker, what, version,
                      ack.worker, ack.adapter or "weights", ack.version)
            continue
        acks[worker] = ack
    return acks


def _claimed_version(raw: bytes | str) -> int:
    """The version an adapter's ack claims (its signature, checked next, covers it); -1 if unreadable."""
    try:
        value = json.loads(raw)
        if isinstance(value, dict) and "body" in value:
            value = json.loads(value["body"])
        version = value.get("version") if isinstance(value, dict) else None
    except (ValueError, TypeError):
        return -1
    return version if isinstance(version, int) and 0 <= version < 2**62 else -1


def _roll_back(conn: redis.Redis, pool: str, before: DesiredState, pushed: DesiredState) -> DesiredState:
    """Put the pool's weights back as they were before a push no worker took (its pause flag and
    anything changed since are kept); the pushed version can then be pushed again."""
    weights = ("weight_version", "weight_path", "swap_mode", "weight_source")

    def restore(state: DesiredState) -> DesiredState:
        if any(getattr(state, name) != getattr(pushed, name) for name in weights):
            return state  # pushed over meanwhile: that push decides
        return state.model_copy(update={name: getattr(before, name) for name in weights})

    restored = _change(conn, pool, restore)
    log.warning("weight push of v%d to pool %s: no worker loaded it; the pool's weights are back at v%d (%s)",
                pushed.weight_version, pool, restored.weight_version, restored.weight_path or "as started")
    return restored


class _AlreadyApplied(Exception):
    """Raised inside `_change` when the stored state is already the one being written."""

    def __init__(self, state: DesiredState) -> None:
        super().__init__(state.generation)
        self.state = state


def _change_unless_applied(
    conn: redis.Redis, where: keys.PoolKeys, update: Callable[[DesiredState], DesiredState],
    also: Callable[[redis.client.Pipeline], None] | None = None,
) -> DesiredState:
    """`_change`, where `update` raises `_AlreadyApplied` when the stored state already holds the
    change: that state, confirmed on a replica and announced to the workers again."""
    try:
        return _change(conn, where.name, update, also)
    except _AlreadyApplied as applied:
        _confirm(conn, where, applied.state)
        conn.publish(where.control_channel, str(applied.state.generation))
        return applied.state


def push_weights(
    conn: redis.Redis,
    path: str,
    version: int,
    *,
    timeout: float | None = DEFAULT_PUSH_TIMEOUT_S,
    force: bool = False,
    mode: SwapMode = "drain",
    pool: str | None = None,
    source: WeightSource = "checkpoint",
) -> PushResult:
    """Make every worker of the pool load `path` as `version`; wait for all its live workers' acks
    (workers of other pools are neither paused nor reloaded). `source="store"`: `path` is a weight
    store's URL holding `version` (`pipeline.core.weights.store`), applied as deltas where workers can.

    `mode` "drain" (the default) loads between batches: every sample in flight finishes on the
    old weights first. "partial" stops the samples in flight at their next step, loads, and
    continues them on the new weights (each token keeps the version that generated it).
    Raises `WeightVersionError` if `version` is not newer than the current one (unless
    `force`), and `WeightPushError` naming the workers that failed or did not answer in time.

    All or nothing: when no live worker loaded the weights (each failed or did not answer), the
    pool's desired weights are put back as they were (the version can be pushed again). When
    some loaded and some failed, the push stands; the workers that failed take no job (they are
    `unhealthy`, handing jobs back) until they load it (a `force` re-push retries). With no live
    worker at all the push is recorded for the workers that join; one that cannot load it
    refuses to join. A pool whose previous version workers acknowledged but that shows no live
    worker (right after a Redis failover, their entries lost with the old master) is given
    `NO_WORKERS_WAIT_S` for their next heartbeats before the push answers.
    """
    if version < 0:
        raise WeightVersionError(f"weight version must be >= 0, got {version}")
    if mode not in SWAP_MODES:
        raise PipelineError(f"swap mode must be one of {', '.join(SWAP_MODES)}, not {mode!r}")
    check_weight_path(str(path))

    before: list[DesiredState] = []

    def update(state: DesiredState) -> DesiredState:
        pushed = (version, str(path), mode, source)
        if before and (state.weight_version, state.weight_path, state.swap_mode, state.weight_source) == pushed:
            # A retry after our own EXEC went out but its reply was lost (a failover, a dropped
            # connection: redis-py reports that as a WatchError): the push is already in.
            raise _AlreadyApplied(state)
        before[:] = [state]
        if version <= state.weight_version and not force:
            raise WeightVersionError(
                f"weight version {version} is not newer than the current version {state.weight_version}; "
                "push a higher version or pass force"
            )
        return state.model_copy(update={"weight_version": version, "weight_path": str(path), "swap_mode": mode,
                                        "weight_source": source})

    started = time.monotonic()
    # A fresh push collects fresh acknowledgements.
    where = keys.pool(pool)
    state = _change_unless_applied(conn, where, update, also=lambda pipe: pipe.delete(where.weight_acks(version)))
    had_workers = bool(before) and bool(conn.hlen(where.weight_acks(before[0].weight_version)))
    mine, missing = _await_acks(conn, where, lambda: read_acks(conn, version, where.name), lambda _: True,
                                started=started, timeout=timeout, had_workers=had_workers)
    failed = {a.worker: a.error or "unknown error" for a in mine if not a.ok}
    if failed or missing:
        rolled_back = None
        if not any(a.ok for a in mine):
            rolled_back = _roll_back(conn, where.name, before[0], state)
        raise WeightPushError(version, failed, missing, mine, rolled_back=rolled_back)
    return PushResult(version=version, path=str(path), generation=state.generation,
                      seconds=time.monotonic() - started, acks=mine)


def _await_acks(
    conn: redis.Redis, where: keys.PoolKeys, read: Callable[[], dict[str, WeightAck]],
    counts: Callable[[WeightAck], bool], *, started: float, timeout: float | None, had_workers: bool,
    waits_for: Callable[[WorkerInfo], bool] = lambda _: True,
) -> tuple[list[WeightAck], list[str]]:
    """Wait until every live worker of the pool that `waits_for` has an ack that `counts` (or until
    `timeout` after `started`); (those acks, the workers still missing). With no such worker, a pool
    whose workers answered before (`had_workers`) is given `NO_WORKERS_WAIT_S` for their entries."""
    deadline = None if timeout is None else started + timeout
    while True:
        live = [w.worker_id for w in registry.live_workers(conn, where.name) if waits_for(w)]
        acks = {worker: ack for worker, ack in read().items() if counts(ack)}
        missing = [w for w in live if w not in acks]
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if not missing and (live or not had_workers or now - started >= NO_WORKERS_WAIT_S):
            break
        time.sleep(_POLL_S)
    return [acks[w] for w in live if w in acks], missing


@dataclass
class AdapterAcks:
    """The answers of a pool's adapter-serving workers to the push of an adapter version."""

    name: str
    version: int
    generation: int
    acks: list[WeightAck]  # one per live worker that answered, for this version or a newer one
    failed: dict[str, str]  # worker -> why it could not read or check the version
    missing: list[str]  # live workers serving adapters that did not answer in time


def announce_adapter(conn: redis.Redis, name: str, version: int, *, timeout: float | None = DEFAULT_PUSH_TIMEOUT_S,
                     pool: str | None = None, mode: SwapMode = "drain") -> AdapterAcks:
    """Tell the pool's workers that adapter `name` has version `version` (already published in the
    adapter registry) and wait for every live worker serving adapters to acknowledge it, or a newer
    version (a racing push's): each reads it from the store and checks it, and runs it for every job
    it admits from then on; with `mode="partial"` it also stops the samples in flight on an older
    version of `name` and continues them on this one before it answers. Never raises for the
    workers' answers: the caller decides."""
    where = keys.pool(pool)

    def update(state: DesiredState) -> DesiredState:
        if state.adapters.get(name, 0) >= version:
            raise _AlreadyApplied(state)  # a newer push of the name went first, or our own EXEC's reply was lost
        modes = {k: v for k, v in state.adapter_swap_modes.items() if k != name}
        if mode != "drain":
            modes[name] = mode
        return state.model_copy(update={"adapters": {**state.adapters, name: version}, "adapter_swap_modes": modes})

    started = time.monotonic()
    state = _change_unless_applied(conn, where, update)
    mine, missing = _await_acks(
        conn, where, lambda: read_adapter_acks(conn, name, where.name), lambda ack: ack.version >= version,
        started=started, timeout=timeout, had_workers=bool(conn.hlen(where.adapter_acks(name))),
        waits_for=lambda worker: worker.capabilities.lora_adapters)
    failed = {a.worker: a.error or "unknown error" for a in mine if not a.ok}
    return AdapterAcks(name, version, state.generation, mine, failed, missing)


def withdraw_adapter(conn: redis.Redis, name: str, version: int, previous: int | None,
                     pool: str | None = None) -> None:
    """Undo `announce_adapter` of a version no worker took: the pool's state names `previous` again
    (or no version of `name`), unless a newer push changed it meanwhile."""

    def restore(state: DesiredState) -> DesiredState:
        if state.adapters.get(name) != version:
            return state
        adapters = {k: v for k, v in state.adapters.items() if k != name}
        if previous is not None:
            adapters[name] = previous
        modes = {k: v for k, v in state.adapter_swap_modes.items() if k != name}
        return state.model_copy(update={"adapters": adapters, "adapter_swap_modes": modes})

    _change(conn, pool, restore)
