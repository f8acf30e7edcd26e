"""Small helpers the tests share: a free loopback port, waiting for a condition, stopping a process,
a flaky object store."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import httpx
from fsspec.implementations.memory import MemoryFileSystem


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports on 127.0.0.1 that nothing listens on right now (for a
    launcher that takes a base port and uses the next ones too)."""
    for _ in range(100):
        base = free_port()
        sockets = []
        try:
            for port in range(base + 1, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def wait_until(check: Callable[[], bool], timeout: float = 10, what: str = "the condition") -> None:
    """Poll `check` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_healthy(url: str, process: subprocess.Popen, log: Path, *, timeout_s: float, what: str,
                 interval_s: float = 0.1) -> None:
    """Poll `url`/health until it answers 200; fail with the tail of `log` if `process` exits or
    `timeout_s` passes first (`what` names the server in the message)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode}); log {log}:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"{what} did not answer /health within {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")


def log_tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def terminate(process: subprocess.Popen, timeout: float = 5) -> None:
    """SIGTERM `process` and reap it; SIGKILL if it has not exited after `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_all(processes: list[subprocess.Popen], timeout: float = 30) -> list[subprocess.Popen]:
    """SIGTERM every process still running (warm shutdown, all at once), reap each; SIGKILL any that
    has not exited after `timeout` seconds, after a SIGUSR1 (a `pipeline worker` dumps every
    thread's stack to its stderr on it). The ones that needed the SIGKILL."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    stuck = []
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stuck.append(process)
            process.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2)
            process.kill()
            process.wait()
    return stuck


class FlakyStore(MemoryFileSystem):
    """`flakystore://`: an in-memory object store whose first `failures` puts fail like a 503 from S3.

    `attempts` lists, per put, the files in `spill_dir` at that moment (empty when none is watched).
    """

    protocol = "flakystore"
    failures: ClassVar[int] = 0
    attempts: ClassVar[list[list[str]]] = []
    spill_dir: ClassVar[Path | None] = None

    @classmethod
    def install(cls, *, failures: int, spill_dir: Path | None = None) -> type[FlakyStore]:
        fsspec.register_implementation(cls.protocol, cls, clobber=True)
        cls.failures, cls.attempts, cls.spill_dir = failures, [], spill_dir
        cls.store, cls.pseudo_dirs = {}, [""]  # MemoryFileSystem keeps its files on the class
        return cls

    def pipe_file(self, path: str, value: bytes, **kwargs: object) -> None:
        cls = type(self)
        cls.attempts.append(sorted(p.name for p in cls.spill_dir.iterdir()) if cls.spill_dir else [])
        if len(cls.attempts) <= cls.failures:
            raise OSError("503 Slow Down: the object store refused the put")
        super().pipe_file(path, value, **kwargs)


def burst_worker(conn: Any, engine: Any, *, close: bool = False, **kwargs: Any) -> Any:
    """Run a `RolloutWorker` around `engine` in this thread until the queue is empty (RQ's burst
    mode), polling control state every 0.1 s unless `control_poll_s` says otherwise; `close`: close
    the engine afterwards. Returns the worker."""
    from workers.process.worker import RolloutWorker

    return run_burst(RolloutWorker(conn, engine, **{"control_poll_s": 0.1, **kwargs}), close=close)


@contextlib.contextmanager
def own_signal_handlers() -> Iterator[None]:
    """An in-process worker installs SIGTERM/SIGINT handlers (RQ's) and leaves them installed: a
    signal after it returned would raise `StopRequested` wherever pytest is then (issue 45 saw one in
    a later test's `wait_until`). The handlers before it are put back when the block ends, once any
    signal already delivered has run (against a handler that absorbs it)."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number in previous:
            signal.signal(number, lambda *_: None)
        time.sleep(0)  # a signal already delivered runs its (absorbing) handler here
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_burst(worker: Any, *, close: bool = False) -> Any:
    """Run a built worker in this thread until the queue is empty; `close`: close its engine afterwards."""
    try:
        with own_signal_handlers():
            worker.work(burst=True, with_scheduler=False, logging_level="WARNING")
    finally:
        if close:
            worker.engine.close()
    return worker


def drive_worker(conn: Any, engine: Any, driver: Callable[[], None], *, stop_when_done: bool = False,
                 **kwargs: Any) -> Any:
    """Run a `RolloutWorker` around `engine` in this thread (it installs signal handlers) until it
    has been idle 2 s, while `driver` acts from another thread; re-raise the driver's failure.
    `stop_when_done`: instead of the idle limit, a SIGTERM (a warm shutdown) once `driver` returns,
    for drivers that may leave the queue empty for a while (an agent between its calls).
    Closes the engine; returns the worker."""
    import os
    import signal
    import threading

    from workers.process.worker import RolloutWorker

    errors: list[BaseException] = []
    worked = threading.Event()

    def run() -> None:
        try:
            driver()
        except BaseException as exc:
            errors.append(exc)
        finally:
            if stop_when_done:
                # Once this worker's own handler is installed: before it, SIGTERM would end pytest (or
                # reach an earlier worker's handler, which RQ leaves installed).
                wait_until(lambda: signal.getsignal(signal.SIGTERM) == worker.request_stop or worked.is_set(),
                           600, "the worker's SIGTERM handler")
                if not worked.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)

    worker = RolloutWorker(conn, engine, control_poll_s=0.1, **kwargs)
    thread = threading.Thread(target=run)
    with own_signal_handlers():  # the driver's SIGTERM may land just after the worker ended on its own
        thread.start()
        try:
            worker.work(burst=False, max_idle_time=None if stop_when_done else 2, with_scheduler=False,
                        logging_level="WARNING")
        finally:
            worked.set()
            thread.join(timeout=30)
            engine.close()
    if errors:
        raise errors[0]
    return worker
