"""A private asyncio event loop on a daemon thread, driven from synchronous code.

The engine interface is synchronous (the worker calls `generate()` from RQ's job thread), but
the SGLang adapters talk asyncio. One long-lived loop keeps httpx's connection pool alive
across batches (a fresh `asyncio.run` per batch would throw it away). If the calling thread is
interrupted while it waits (KeyboardInterrupt, RQ's job-timeout signal), the coroutine is
cancelled and given a moment to clean up (abort its requests) before the exception goes on.

`gather_or_cancel` is the batch rule the SGLang and vLLM adapters follow: all or nothing, and the
first failure cancels everything still running; `run_batch` applies it to a batch's calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
C = TypeVar("C")
R = TypeVar("R")
S = TypeVar("S")


class AsyncBridge:
    """Runs coroutines on one background loop and waits for them synchronously."""

    def __init__(self, *, name: str = "engine-loop", cleanup_timeout_s: float = 10.0) -> None:
        self.cleanup_timeout_s = cleanup_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion on the loop; cancel it if this thread is interrupted."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the engine's event loop is closed")
        done = threading.Event()
        box: dict[str, asyncio.Task[T]] = {}

        def start() -> None:
            task = self._loop.create_task(coro)
            box["task"] = task
            task.add_done_callback(lambda _: done.set())

        def cancel() -> None:
            task = box.get("task")
            if task is not None:
                task.cancel()

        self._loop.call_soon_threadsafe(start)
        try:
            # Short waits keep the calling thread responsive to signals.
            while not done.wait(0.05):
                pass
        except BaseException:
            self._loop.call_soon_threadsafe(cancel)
            done.wait(self.cleanup_timeout_s)
            raise
        return box["task"].result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


async def gather_or_cancel(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run all concurrently; on the first failure (or cancellation) cancel the rest, let them
    clean up, and raise it."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_batch(requests: Sequence[R], plan: Callable[[R], list[C]],
                    answer: Callable[[C], Awaitable[list[S]]]) -> list[list[S]]:
    """Every call `plan` makes of every request at once (the first failure cancels the rest; a
    request `plan` refuses sends nothing at all), each request's samples regrouped in call order."""
    calls = [(index, call) for index, request in enumerate(requests) for call in plan(request)]
    answers = await gather_or_cancel(answer(call) for _, call in calls)  # type: ignore[arg-type]
    outputs: list[list[S]] = [[] for _ in requests]
    for (index, _), samples in zip(calls, answers, strict=True):
        outputs[index].extend(samples)
    return outputs
