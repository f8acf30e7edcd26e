"""A daemon thread that calls a function every interval until stopped: a worker's upkeep threads
(the turn flusher, the turn-queue keeper) share it."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Periodic:
    """Calls `tick()` every `interval_s` (the first call one interval after `start`) on a daemon
    thread named `name`; an exception from `tick` goes to `on_error`, called inside the `except`
    (so `log.exception` works there), and the thread goes on."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], object], *,
                 on_error: Callable[[Exception], object]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._tick = tick
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop, waiting at most `timeout_s` for a tick in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception as exc:  # the thread must outlive any one failure
                self._on_error(exc)
