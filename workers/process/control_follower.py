"""The control channel, worker side (docs/design.md "Control channel"): wake-ups, the desired state
followed, weight loads with acknowledgements.

`ControlListener` subscribes to the wake-up channel first and only then asks the worker to
read the desired state; it asks again on every message, after every reconnect and every
`poll_s` seconds, so a missed message, a Redis restart or a late start all converge.

`ControlFollower` is what a worker does on each read (on the listener's thread, and in the work
loop before every job): it refuses a state older than one it followed (and writes the one it
follows back), loads pushed weights while no batch runs (a drain through the feeder's gate) or,
in `partial` mode on an engine that can interrupt, stops the samples in flight, loads, and
continues them on the new weights (`Feeder.partial_swap`; an engine that cannot interrupt
drains instead, and its acknowledgement says `mode: drain`). What of a load needs no pause (a
store version staged and checked, or materialised: `prepare_load`) runs first, while the engine
still generates. Adapter versions the state names are staged and acknowledged by
`workers.process.adapter_follower`. While the pool is paused the work
loop waits in `wait_until_resumed`; a job dequeued meanwhile is handed back
(`workers.process.intake`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.broker.security import check_weight_path
from pipeline.core.errors import PolicyError, WriteLostError
from schemas.control import DesiredState, SwapMode, WeightAck, WeightSource
from schemas.worker_info import WorkerState
from workers.engines.base import Engine
from workers.errors import WeightsRefusedError
from workers.jobs.feeder import Feeder
from workers.process.acks import write_ack
from workers.process.adapter_follower import AdapterFollower
from workers.process.heartbeat import Heartbeat
from workers.process.store_load import prepare_store_load, scratch_dir

log = logging.getLogger(__name__)

POLL_S = 3.0  # the state read without a message (one missed, a Redis restart); pub/sub wakes at once


class ControlListener:
    """A daemon thread calling `on_wake` on subscribe, on every message on `channel` (the pool's
    wake-up channel), on reconnect and periodically."""

    def __init__(self, conn: redis.Redis, channel: str, on_wake: Callable[[], Any], *, poll_s: float = POLL_S) -> None:
        self.conn = conn
        self.channel = channel
        self.on_wake = on_wake
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._pubsub: redis.client.PubSub | None = None
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)

    def start(self) -> None:
        """Subscribe (so no later change is missed), then start the thread, which reads the state first."""
        try:
            self._subscribe()
        except redis.RedisError as exc:
            log.warning("control channel: subscribe failed (%s); will retry", exc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._close()

    def _subscribe(self) -> None:
        self._close()
        pubsub = self.conn.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.channel)
        self._pubsub = pubsub

    def _close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                self._pubsub.close()
            self._pubsub = None

    def _wake(self) -> None:
        try:
            self.on_wake()
        except Exception:  # the listener must outlive any one failure
            log.exception("control channel: handling a wake-up failed")

    def _loop(self) -> None:
        backoff = 0.1
        self._wake()
        while not self._stop.is_set():
            try:
                if self._pubsub is None:
                    self._subscribe()
                    backoff = 0.1
                    self._wake()  # reconnected: whatever was published meanwhile is in the state
                assert self._pubsub is not None
                self._pubsub.get_message(timeout=self.poll_s)
                # A message, or poll_s without one: read the state either way.
                self._wake()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                log.warning("control channel: %s; reconnecting in %.1f s", exc, backoff)
                self._close()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)


@dataclass
class PreparedLoad:
    """A weight load with the work that needs no pause done (`prepare_load`): `load(mode)`, run
    with the engine stopped, does the rest and answers the ack (`seconds`: that pause)."""

    engine: Engine
    worker_id: str
    version: int
    finish: Callable[[], dict[str, Any]] | None  # None: the load already failed (`error`)
    error: str | None = None
    prepare_s: float = 0.0

    def load(self, mode: SwapMode) -> WeightAck:
        """Never raises: failures become ok=false acks."""
        if self.finish is None:
            return WeightAck(worker=self.worker_id, version=self.version, ok=False, seconds=0.0, error=self.error,
                             mode=mode)
        started = time.monotonic()
        error: str | None = None
        how: dict[str, Any] = {}
        try:
            how = self.finish()
            if self.engine.weight_version != self.version:
                raise RuntimeError(f"engine reports weight version {self.engine.weight_version} after loading "
                                   f"{self.version}")
        except Exception as exc:  # any load failure is reported; old weights stay
            error = f"{type(exc).__name__}: {exc}"
        return WeightAck(worker=self.worker_id, version=self.version, ok=error is None,
                         seconds=float(time.monotonic() - started), error=error, mode=mode,
                         prepare_seconds=float(self.prepare_s), **how)


def prepare_load(
    engine: Engine, worker_id: str, path: str, version: int, source: WeightSource = "checkpoint",
    have: int | None = None,
) -> PreparedLoad:
    """What of loading `path` as `version` can run while the engine generates: the path checked; for
    a store push (`path` a weight store, `have` the version of it the engine serves, if any) the
    version staged or materialised (`workers.process.store_load`). Never raises."""
    try:
        check_weight_path(path)
    except PolicyError as exc:
        log.error("worker %s: refusing to load weights v%d: %s", worker_id, version, exc)
        return PreparedLoad(engine, worker_id, version, None, f"refused: {exc}")
    if source != "store":
        def reload() -> dict[str, Any]:
            engine.update_weights(path, version)
            return {}
        return PreparedLoad(engine, worker_id, version, reload)
    started = time.monotonic()
    try:
        finish = prepare_store_load(engine, path, version, have, scratch_dir(worker_id))
    except Exception as exc:  # reported in the ack; the engine's weights were not touched
        return PreparedLoad(engine, worker_id, version, None, f"{type(exc).__name__}: {exc}",
                            time.monotonic() - started)
    return PreparedLoad(engine, worker_id, version, finish, None, time.monotonic() - started)


def load_weights(
    engine: Engine, worker_id: str, path: str, version: int, mode: SwapMode = "drain",
    source: WeightSource = "checkpoint", have: int | None = None,
) -> WeightAck:
    """Prepare and load at once (`prepare_load`, then `PreparedLoad.load`); never raises."""
    return prepare_load(engine, worker_id, path, version, source, have).load(mode)


class ControlFollower:
    """One worker following its pool's desired state; `worker_id` and `engine` name what loads.

    `report(state)` publishes the worker's registry state ("updating" while loading); `settle()`
    publishes its resting state unless a job is in flight. `heartbeat` is the registry entry the
    followed generation and the weights served are written to."""

    def __init__(
        self, conn: redis.Redis, pool: keys.PoolKeys, worker_id: str, engine: Engine, feeder: Feeder,
        heartbeat: Heartbeat, *, report: Callable[[WorkerState], Any], settle: Callable[[], Any],
        poll_s: float = POLL_S,
    ) -> None:
        self.conn = conn
        self.pool = pool
        self.worker_id = worker_id
        self.engine = engine
        self.feeder = feeder
        self.heartbeat = heartbeat
        self.report = report
        self.settle = settle
        # Serialises control handling between the listener and the work loop.
        self._lock = threading.RLock()
        self.desired = DesiredState()
        self._refused_generation: int | None = None
        self._followed: bytes | None = None  # the stored record of the state followed (as read)
        # What the engine serves (version, path; no path: as it started), and the last load tried
        # (target and generation: a failed load is retried at the next change of the state).
        self._loaded: tuple[int, str | None] = (engine.weight_version, None)
        self._attempted: tuple[int, str | None, int] = (engine.weight_version, None, 0)
        self._last_ack: WeightAck | None = None
        self.weight_error: str | None = None
        self.adapters = AdapterFollower(conn, pool, worker_id, engine, feeder)
        self.changed = threading.Event()  # set after every read of the state
        self.listener = ControlListener(conn, pool.control_channel, self._on_wake, poll_s=poll_s)

    def behind(self, state: DesiredState) -> bool:
        """Whether the engine does not serve the pool's desired weights (a load failed or is due)."""
        return state.weight_path is not None and self._loaded != (state.weight_version, state.weight_path)

    def resting_state(self) -> WorkerState:
        """The worker's registry state while no job is in flight."""
        if self.desired.paused:
            return "paused"
        return "unhealthy" if self.behind(self.desired) else "idle"

    def _on_wake(self) -> None:
        """A control wake-up (or the listener's poll): follow the desired state, abort canceled jobs."""
        self.sync()
        if self.feeder.in_flight:
            aborted = self.feeder.abort_canceled()
            if aborted:
                log.info("worker %s: aborted %d canceled job(s) in flight", self.worker_id, aborted)

    def sync(self) -> DesiredState:
        """Re-read the desired state; load pushed weights if they changed; refresh the registry.

        Called by the listener thread on every wake-up and by the work loop before every job;
        a load first drains every batch in flight, so weights only ever change between batches.
        The state is read under the lock: a read taken while the other thread applied a newer
        generation would look older than the one followed, and be refused as a replay.
        """
        with self._lock:
            try:
                raw = self.conn.get(self.pool.control_state)
                state = control_channel.parse_state(raw, self.pool.name)
            except (redis.RedisError, control_channel.ControlAuthError) as exc:  # forged/unsigned: refused, logged
                log.warning("control state unreadable (%s); keeping %s", exc, self.desired)
                return self.desired
            followed = self.heartbeat.info.control_generation
            if state.generation < followed:
                # Older than one already followed: a replayed record (signed states can be copied),
                # Redis restored from an old snapshot, or a failover that lost the newer one. The
                # record followed is written back (`restore_state`), so Redis and workers agree.
                if state.generation != self._refused_generation:
                    self._refused_generation = state.generation
                    log.warning("control state of generation %d refused: generation %d was already applied "
                                "(a replayed or restored record, or one a Redis failover lost?); keeping %s and "
                                "writing it back", state.generation, followed, self.desired)
                    self._restore_followed()
                return self.desired
            self.desired = state
            self._followed = raw
            with self.heartbeat.lock:
                self.heartbeat.info.control_generation = state.generation
            try:
                if not self.behind(state):
                    self.weight_error = None  # loaded, or a push no worker took was undone
                if state.weight_path is not None and self.behind(state) and \
                        (state.weight_version, state.weight_path, state.generation) != self._attempted:
                    # Due, or failed before and the state changed since (a --force re-push retries).
                    self._swap(state, state.weight_path)
                elif self._last_ack is not None and self._last_ack.version == state.weight_version:
                    # Acks lost (Redis restarted, or a forced re-push of the same weights): answer again.
                    write_ack(self.conn, self._last_ack, self.pool.name, only_if_missing=True)
                self.adapters.follow(state)
            except (redis.RedisError, WriteLostError) as exc:  # acked again at the next read of the state
                log.warning("control acknowledgement failed: %s", exc)
            self.settle()
        self.changed.set()
        return state

    def _restore_followed(self) -> None:
        """Write the state record this worker follows back to Redis, where an older one stands."""
        if self._followed is None:
            return
        try:
            control_channel.restore_state(self.conn, self._followed, self.pool.name)
        except (redis.RedisError, WriteLostError) as exc:
            log.warning("writing the control state back failed (%s); retried at the next read", exc)
            self._refused_generation = None

    def _swap(self, state: DesiredState, path: str) -> None:
        """Load pushed weights: partially (samples in flight continue on them) or after a drain. What
        needs no pause (a store version staged and checked) runs first, while the engine generates."""
        feeder = self.feeder
        version = state.weight_version
        # A store push applies deltas from the version of that store the engine serves, if any.
        have = self._loaded[0] if state.weight_source == "store" and self._loaded[1] == path else None
        prepared = prepare_load(self.engine, self.worker_id, path, version, state.weight_source, have)
        partial = state.swap_mode == "partial" and feeder.can_interrupt
        if prepared.finish is None:  # failed before the engine had to stop: nothing to pause for
            self._load_weights(state, path, prepared, "partial" if partial else "drain")
            return
        if partial:
            stopped = feeder.partial_swap(lambda: self._load_weights(state, path, prepared, "partial"))
            log.info("worker %s: partial swap to v%d: %d sample(s) stopped and continued",
                     self.worker_id, version, stopped)
            return
        if state.swap_mode == "partial":
            log.warning("worker %s: partial swap asked, but the %s engine cannot stop samples in flight (it "
                        "generates one batch at a time: --no-feed, or no concurrent interface); draining instead",
                        self.worker_id, self.engine.description.name)
        with feeder.gate.exclusive():
            self._load_weights(state, path, prepared, "drain")

    def _load_weights(self, state: DesiredState, path: str, prepared: PreparedLoad, mode: SwapMode) -> None:
        version = state.weight_version
        self._attempted = (version, path, state.generation)
        self.report("updating")
        log.info("worker %s: loading weights v%d from %s (%s)", self.worker_id, version, path, mode)
        ack = prepared.load(mode)
        if ack.ok:
            self.weight_error = None
            self._loaded = (version, path)
            log.info("worker %s: serving weights v%d (paused %.2f s after %.2f s of preparation, %s%s)",
                     self.worker_id, version, ack.seconds, prepared.prepare_s, ack.applied,
                     f": {ack.detail}" if ack.detail else "")
        else:
            self.weight_error = f"loading weights v{version} from {path} failed: {ack.error}"
            log.error("worker %s: %s; taking no job until it loads the pool's weights (retried at the next "
                      "push, e.g. `pipeline weights push --force`)", self.worker_id, self.weight_error)
        self._last_ack = ack
        # The registry shows the version served before the ack says so: whoever waits on the ack
        # and then reads the registry must see the new version.
        self.heartbeat.update(weight_version=self.engine.weight_version, error=self.weight_error)
        write_ack(self.conn, ack, self.pool.name)

    def wait_until_resumed(self, *, burst: bool, stopping: Callable[[], bool]) -> bool:
        """Block while paused (False in burst mode, or once `stopping()`: the worker then exits instead).
        Running as last read, it returns without a read: the work loop reads the state again after
        every dequeue (`JobIntake`), before anything runs, which catches a pause that came meanwhile."""
        if not self.desired.paused:
            return True
        while True:
            self.changed.clear()
            if not self.sync().paused:
                return True
            if burst or stopping():
                return False
            self.changed.wait(self.listener.poll_s)

    def wait_for_change(self) -> None:
        """Until the state is read again (the listener reads it at least every `poll_s`)."""
        self.changed.clear()
        self.changed.wait(self.listener.poll_s)

    def join(self) -> None:
        """Load the pool's desired weights before the first job; refuse to join if they do not load
        (another model's checkpoint, mismatched parameters, a path this host cannot read): rows at
        this engine's own version would mean something else than the pool's. With nothing pushed,
        an engine with `refuses_pool(live workers)` (the sim) may refuse the pool its workers serve."""
        state = self.sync()
        description = self.engine.description
        refuses_pool = getattr(self.engine, "refuses_pool", None)
        if state.weight_path is None and refuses_pool is not None:
            others = [w for w in registry.live_workers(self.conn, self.pool.name) if w.worker_id != self.worker_id]
            reason = refuses_pool(others)
            if reason:
                raise WeightsRefusedError(f"worker {self.worker_id} ({description.name} engine, model "
                                          f"{description.model}) does not join pool {self.pool.name!r}: {reason}")
        if not self.behind(state):
            return
        raise WeightsRefusedError(
            f"worker {self.worker_id} ({description.name} engine, model {description.model}) does not join pool "
            f"{self.pool.name!r}: the pool serves weights v{state.weight_version} from {state.weight_path} and this "
            f"engine cannot load them: {self.weight_error or 'not loaded'}. Start it with a model that takes that "
            "checkpoint, in another --pool, or push weights every worker of the pool loads (`pipeline weights push "
            "PATH --version N --force`)"
        )
