"""The concurrent interface for an engine that decodes one batch at a time.

`SerialBatches` runs submitted batches in order on one thread (`_run_batch(requests, stop)`), so
a worker feeds such an engine like a continuous-batching one (`workers.jobs.feeder`): the next
job waits inside the engine instead of in Redis. `stop` is an event set when the batch's future
is cancelled (a job timeout or a cancel: the result is dropped); an engine whose decode loop
checks it at every step stops early. Each batch runs in the context (`contextvars`) it was
submitted from, so its log lines name the job (`workers.runtime.logs`).

`SerialFeed` adds the interruptible interface (the hf engine): `interrupt()` (a partial weight
swap) ends the running batch at its next step, every unfinished sample with
`Finish("abort", message=INTERRUPTED)` and the tokens it has; batches still queued resolve at
once with empty interrupted samples.

`progress(future)` (both) reports a batch's samples so far without stopping them (a worker's
periodic checkpoints, streamed agent turns), from the engine's `_running_progress`; `SerialEngine`
asks the engine it wraps (`running_progress()`, where it has one: the fake's paced batches).

`SerialEngine` puts any engine behind the concurrent interface through its `generate()`: the
shipped fake, the in-process `sglang` engine, and any engine of a worker started with
`--no-feed`. A `generate()` call cannot be stopped part-way, so it is not interruptible (a
partial swap drains) and a cancelled batch runs to its end before the next one starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import numpy as np

from schemas.request import RolloutRequest
from workers.engines.base import INTERRUPTED, Engine, EngineDescription, Finish, SampleOutput


@dataclass(eq=False)
class _Queued:
    requests: list[RolloutRequest]
    future: Future
    samples: int
    stop: threading.Event = field(default_factory=threading.Event)
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


def interrupted_before_start(requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
    """Outputs of a batch stopped before its first step: no tokens, every sample interrupted."""
    return [[SampleOutput(token_ids=np.empty(0, np.int32), finish=Finish("abort", message=INTERRUPTED),
                          logprobs=np.empty(0, np.float32) if r.logprobs is not None else None,
                          top_logprobs=[] if r.logprobs else None)
             for _ in range(r.sampling_params.n)] for r in requests]


def _resolve(future: Future, outputs: list[list[SampleOutput]]) -> None:
    """Set the result unless the future was cancelled meanwhile (the future stays pending while its
    batch runs, so a job timeout can still cancel it: `stop` then ends the batch early)."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(outputs)


class SerialBatches:
    """Mixin: `capacity`, `load()`, `batches_waiting()` and `submit()` over `_run_batch`."""

    _feed_capacity: int

    def _run_batch(self, requests: Sequence[RolloutRequest], stop: threading.Event) -> list[list[SampleOutput]]:
        raise NotImplementedError

    def _feed_state(self) -> tuple[threading.Condition, deque[_Queued]]:
        if not hasattr(self, "_feed_cond"):
            self._feed_cond = threading.Condition()
            self._feed_queue: deque[_Queued] = deque()
            self._feed_running: _Queued | None = None
            self._feed_closed = False
            self._feed_thread = threading.Thread(target=self._feed_loop, name="engine-feed", daemon=True)
            self._feed_thread.start()
        return self._feed_cond, self._feed_queue

    @property
    def capacity(self) -> int:
        return self._feed_capacity

    def load(self) -> int:
        cond, queue = self._feed_state()
        with cond:
            running = self._feed_running.samples if self._feed_running is not None else 0
            return running + sum(item.samples for item in queue)

    def batches_waiting(self) -> int:
        """Batches submitted that have not started: they wait for the running one (a worker feeds
        such an engine one batch ahead, `workers.jobs.feeder.Feeder.has_room`)."""
        cond, queue = self._feed_state()
        with cond:
            return sum(1 for item in queue if not item.future.done())

    def submit(self, requests: Sequence[RolloutRequest]) -> Future[list[list[SampleOutput]]]:
        cond, queue = self._feed_state()
        item = _Queued(list(requests), Future(), sum(r.sampling_params.n for r in requests))
        item.future.add_done_callback(lambda f: item.stop.set() if f.cancelled() else None)
        with cond:
            if self._feed_closed:
                raise RuntimeError("the engine is closed")
            queue.append(item)
            cond.notify_all()
        return item.future

    def _running_progress(self) -> list[list[SampleOutput]] | None:
        """The running batch's samples so far (see `CheckpointableEngine.progress`); None: unknown."""
        return None

    def progress(self, future: Future) -> list[list[SampleOutput]] | None:
        """The samples so far of the batch behind `future`: the running one's from the engine, a
        queued one's empty; None once it resolved (`workers.engines.base.CheckpointableEngine`)."""
        cond, queue = self._feed_state()
        with cond:
            running = self._feed_running
            if running is not None and running.future is future:
                return None if future.done() else self._running_progress()
            queued = next((item for item in queue if item.future is future), None)
        return None if queued is None or future.done() else interrupted_before_start(queued.requests)

    def _feed_loop(self) -> None:
        cond, queue = self._feed_cond, self._feed_queue
        while True:
            with cond:
                while not queue and not self._feed_closed:
                    cond.wait()
                if self._feed_closed:
                    return
                item = queue.popleft()
                if item.future.done():  # cancelled while queued
                    continue
                self._feed_running = item
            try:
                _resolve(item.future, item.context.run(self._run_batch, item.requests, item.stop))
            except BaseException as exc:
                with contextlib.suppress(InvalidStateError):
                    item.future.set_exception(exc)
            finally:
                with cond:
                    self._feed_running = None
                    cond.notify_all()

    def _close_feed(self) -> None:
        if not hasattr(self, "_feed_cond"):
            return
        with self._feed_cond:
            self._feed_closed = True
            pending = list(self._feed_queue)
            self._feed_queue.clear()
            self._feed_cond.notify_all()
        for item in pending:
            item.future.cancel()


class SerialFeed(SerialBatches):
    """Mixin: `SerialBatches` and `interrupt()`, for an engine whose `_run_batch` checks `stop`."""

    def interrupt(self) -> int:
        """Stop the running batch at its next step; resolve the queued ones as not started."""
        cond, queue = self._feed_state()
        with cond:
            queued = list(queue)
            queue.clear()
            running = self._feed_running
            if running is not None:
                running.stop.set()
        for item in queued:
            _resolve(item.future, interrupted_before_start(item.requests))
        with cond:
            cond.wait_for(lambda: self._feed_running is None or self._feed_running is not running)
        return sum(item.samples for item in queued) + (running.samples if running is not None else 0)


class SerialEngine(SerialBatches):
    """`engine` behind the concurrent interface: its batches run one at a time through `generate()`.

    Room for one sample (`capacity` 1): a batch is taken only once the one before it has ended.
    Only batches go through it; weight loads, health probes and closing stay with `engine`.
    """

    _feed_capacity = 1

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def description(self) -> EngineDescription:
        return self.engine.description

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def _run_batch(self, requests: Sequence[RolloutRequest], stop: threading.Event) -> list[list[SampleOutput]]:
        return self.engine.generate(requests)

    def _running_progress(self) -> list[list[SampleOutput]] | None:
        """The running batch's samples so far, when `engine` reports them (`running_progress()`)."""
        report = getattr(self.engine, "running_progress", None)
        return report() if callable(report) else None

    def close(self) -> None:
        """Stop feeding (batches still queued are cancelled); `engine` stays open for its owner."""
        self._close_feed()
