"""`pipeline agent-worker`: a CPU process that runs up to C agent episodes at once, any number of
them on any host, against `pipeline serve`.

It reads its agents' episode streams through the pool's consumer group (`pipeline.core.jobs.episodes`)
as slots free up, keeps the entries it holds fresh, and takes over the entries of agent workers that
went silent (`claim_after_s`: SIGKILLed, their host gone). Each episode runs as attempts until one
finishes or the retries are spent: every attempt opens a fresh session (`POST /sessions`), runs the
agent with an OpenAI client bound to it, and ends the session recording the reward on it (one
call); then the outcome is committed once (`episodes.commit`).

SIGTERM (or SIGINT) stops taking episodes; those in flight get `grace_s` to finish, then are
cancelled (their environments torn down) and handed back (`episodes.hand_back`): another worker
takes them at once and runs them again in fresh sessions (counted as handed back, not abandoned).
A second signal cancels at once. After a SIGKILL nothing is torn down: an environment living
outside the process (a container, a cloud sandbox) outlives it until its own expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from pipeline.core.broker import keys
from pipeline.core.errors import PipelineError
from pipeline.core.jobs import episodes
from pipeline.core.jobs.episodes import Claimed
from schemas.episode import EpisodeJob, EpisodeOutcome
from workers.agents import attempt
from workers.agents.admission import Admission
from workers.agents.episode import Episode
from workers.agents.serve_client import ServeClient
from workers.agents.tracing import episode_span
from workers.errors import EpisodeError

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
DEFAULT_CLAIM_AFTER_S = 30.0
DEFAULT_GRACE_S = 30.0
READ_BLOCK_MS = 1000


class RunCanceled(Exception):
    """The episode was canceled while its attempt ran (its run's cancel): the attempt failed because its
    session ended with the cancel."""


@dataclass
class WorkerStats:
    finished: int = 0
    failed: int = 0
    canceled: int = 0
    retried: int = 0
    taken_over: int = 0
    started_at: float = field(default_factory=time.time)


class AgentWorker:
    """Runs episodes of the agents it was started with (name → callable), in one pool."""

    def __init__(self, conn: redis.Redis, agents: dict[str, Callable[..., Any]], *, serve_url: str,
                 api_key: str | None = None, pool: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                 claim_after_s: float = DEFAULT_CLAIM_AFTER_S, grace_s: float = DEFAULT_GRACE_S,
                 worker_id: str | None = None) -> None:
        if not agents:
            raise PipelineError("an agent worker runs at least one agent (--agent package.module:function)")
        if concurrency < 1:
            raise PipelineError(f"--concurrency {concurrency}: at least 1")
        self.conn = conn
        self.agents = agents
        self.keys = keys.pool(pool)
        self.serve_url = serve_url
        self.api_key = api_key
        self.concurrency = concurrency
        self.claim_after_s = claim_after_s
        self.grace_s = grace_s
        self.worker_id = worker_id or f"agent-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.streams = [self.keys.episode_stream(name) for name in agents]
        self.stats = WorkerStats()
        self.admission = Admission(conn, self.keys.name)
        self._held: dict[str, Claimed] = {}
        self._running: set[asyncio.Task[None]] = set()  # the episodes in flight
        self._tasks: dict[str, asyncio.Task[None]] = {}  # entry id → its episode's task
        self._canceled: set[str] = set()  # entries whose run was canceled: their tasks are being cancelled
        self._handed_back: list[Claimed] = []  # entries stopped by the shutdown, left to another worker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._kept = threading.Event()  # set: the keep-alive thread ends
        self._signals = 0

    # -- the loop ---------------------------------------------------------------------------------

    def work(self, *, burst: bool = False) -> WorkerStats:
        """Run until stopped (a signal), or with `burst` until no episode is left to run or take over."""
        return asyncio.run(self._work(burst))

    async def _work(self, burst: bool) -> WorkerStats:
        for stream in self.streams:
            episodes.STREAMS.ensure_group(self.conn, stream)
        self._loop = asyncio.get_running_loop()
        self._install_signals()
        serve = ServeClient(self.serve_url, self.api_key)
        running = self._running
        keeper = threading.Thread(target=self._keep_alive, name="agent-keep-alive", daemon=True)
        keeper.start()
        log.info("agent worker %s: agents %s, pool %s, up to %d episodes at once, serve %s", self.worker_id,
                 ", ".join(self.agents), self.keys.name, self.concurrency, self.serve_url)
        next_take_over = 0.0
        try:
            while not self._stopping.is_set():
                free = self.concurrency - len(running)
                if free <= 0:
                    await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    running.difference_update({t for t in running if t.done()})
                    continue
                claimed: list[Claimed] = []
                try:
                    if time.monotonic() >= next_take_over:
                        claimed = await asyncio.to_thread(self._take_over, free)
                        next_take_over = time.monotonic() + max(0.5, self.claim_after_s / 4)
                    if len(claimed) < free:
                        block = None if claimed else (100 if running else READ_BLOCK_MS)  # None: do not block
                        claimed += await asyncio.to_thread(episodes.STREAMS.read_new, self.conn, self.streams,
                                                           self.worker_id, free - len(claimed), block)
                except redis.RedisError as exc:  # the episodes in flight carry on
                    log.warning("agent worker %s: reading episodes failed (%s); trying again", self.worker_id, exc)
                    await asyncio.sleep(1.0)
                    continue
                for entry in claimed:
                    self._held[entry.entry_id] = entry
                    task = asyncio.create_task(self._episode(entry, serve))
                    self._tasks[entry.entry_id] = task
                    running.add(task)
                running.difference_update({t for t in running if t.done()})
                if burst and not claimed and not running and await asyncio.to_thread(self._nothing_left):
                    break
            await self._drain(running)
        finally:
            self._kept.set()
            keeper.join(timeout=10)
            if self._handed_back:
                with contextlib.suppress(redis.RedisError):  # else they are taken over after claim_after_s
                    await asyncio.to_thread(episodes.hand_back, self.conn, self.worker_id, self._handed_back)
            await serve.close()
            await asyncio.to_thread(self._unregister)
        log.info("agent worker %s stopped: %d finished, %d failed, %d retried, %d taken over", self.worker_id,
                 self.stats.finished, self.stats.failed, self.stats.retried, self.stats.taken_over)
        return self.stats

    async def _drain(self, running: set[asyncio.Task[None]]) -> None:
        """Give the episodes in flight `grace_s` to finish, then cancel them (their entries stay
        pending: another worker takes them over)."""
        if not running:
            return
        log.info("agent worker %s: %d episode(s) in flight get %g s to finish", self.worker_id, len(running),
                 self.grace_s)
        _done, pending = await asyncio.wait(running, timeout=self.grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            log.warning("agent worker %s: %d episode(s) cancelled; another worker runs them again in fresh "
                        "sessions", self.worker_id, len(pending))

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()

        def stop(name: str) -> None:
            self._signals += 1
            if self._signals == 1:
                log.info("agent worker %s: %s: taking no more episodes", self.worker_id, name)
                self._stopping.set()
            else:
                log.warning("agent worker %s: second signal (%s): cancelling the episodes in flight", self.worker_id,
                            name)
                self.grace_s = 0
                for task in self._running:
                    task.cancel()

        for number, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(number, stop, name)

    def request_stop(self) -> None:
        """Stop as a first SIGTERM would (from the loop's thread)."""
        self._stopping.set()

    # -- holding, taking over, the registry --------------------------------------------------------

    def _take_over(self, count: int) -> list[Claimed]:
        taken: list[Claimed] = []
        for stream in self.streams:
            if len(taken) >= count:
                break
            # Entries of its own this worker runs already (its keep-alive was late) are not run twice.
            taken += [entry for entry in episodes.STREAMS.take_over(self.conn, stream, self.worker_id,
                                                            int(self.claim_after_s * 1000), count - len(taken))
                      if entry.entry_id not in self._held]
        if taken:
            self.stats.taken_over += len(taken)
            log.warning("agent worker %s took over %d episode(s) of silent workers", self.worker_id, len(taken))
        return taken

    def _nothing_left(self) -> bool:
        """No entry queued or held by anyone (burst mode's end): dead workers' entries count until taken over."""
        return episodes.STREAMS.backlog(self.conn, self.streams) == (0, 0)

    def _keep_alive(self) -> None:
        """Its own thread: the episodes this worker holds are kept fresh however busy its event loop
        and thread pool are (held entries left idle past `claim_after_s` would be taken over)."""
        interval = max(0.2, self.claim_after_s / 5)
        while not self._kept.is_set():
            try:
                self._heartbeat()
            except redis.RedisError as exc:
                log.warning("agent worker %s: heartbeat failed (%s); retrying", self.worker_id, exc)
            self._kept.wait(interval)

    def _heartbeat(self) -> None:
        held = list(self._held.values())
        if held:
            episodes.STREAMS.keep_claimed(self.conn, self.worker_id, held)
            self._stop_canceled(held)
        info = {"worker_id": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "agents": sorted(self.agents), "concurrency": self.concurrency, "running": len(held),
                "finished": self.stats.finished, "failed": self.stats.failed, "started_at": self.stats.started_at,
                "serve": self.serve_url}
        ttl = max(5, int(self.claim_after_s * 2))
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.agent_worker(self.worker_id), json.dumps(info), ex=ttl)
            pipe.sadd(self.keys.agent_workers, self.worker_id)
            pipe.execute()

    def _stop_canceled(self, held: list[Claimed]) -> None:
        """Cancel the episodes in flight whose run was canceled (`pipeline cancel`): their outcome is
        written already; the attempt is stopped, its environment torn down and its entry dropped."""
        canceled = episodes.canceled_runs(self.conn, {claimed.job.run for claimed in held})
        for claimed in held:
            if claimed.job.run in canceled and claimed.entry_id not in self._canceled:
                self._canceled.add(claimed.entry_id)
                task = self._tasks.get(claimed.entry_id)
                if task is not None and self._loop is not None:
                    self._loop.call_soon_threadsafe(task.cancel)

    def _unregister(self) -> None:
        with contextlib.suppress(redis.RedisError), self.conn.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.agent_worker(self.worker_id))
            pipe.srem(self.keys.agent_workers, self.worker_id)
            pipe.execute()

    # -- one episode -------------------------------------------------------------------------------

    async def _episode(self, claimed: Claimed, serve: ServeClient) -> None:
        job = claimed.job
        try:
            agent = self.agents.get(job.agent)
            if agent is None:  # its stream is one of this worker's agents': cannot happen unless renamed
                raise RuntimeError(f"episode {job.episode_id} names agent {job.agent!r}, not one of this worker's")
            if not await self.admission.wait(job, self._stopping):
                self._handed_back.append(claimed)  # stopping while it waited: left to another worker
                return
            with episode_span(job) as trace_id:
                outcome = await self._attempts(claimed, agent, serve, trace_id)
            if outcome is None:
                return
            committed = await asyncio.to_thread(episodes.commit, self.conn, claimed, outcome)
            if committed:
                if outcome.status == "finished":
                    self.stats.finished += 1
                else:
                    self.stats.failed += 1
                    log.warning("episode %s of run %s failed after %d attempt(s): %s", job.episode_id, job.run,
                                outcome.attempts, outcome.reason)
            else:
                log.warning("episode %s of run %s was taken over by another worker; this run of it is discarded",
                            job.episode_id, job.run)
        except (asyncio.CancelledError, RunCanceled) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if claimed.entry_id not in self._canceled:
                    self._handed_back.append(claimed)  # shutting down: left to another worker
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self.stats.canceled += 1
            log.info("episode %s of run %s stopped: the run was canceled", job.episode_id, job.run)
            with contextlib.suppress(redis.RedisError):
                await asyncio.to_thread(episodes.acknowledge, self.conn, claimed)
        except Exception:
            log.exception("episode %s of run %s: unexpected error; it stays pending for another worker",
                          job.episode_id, job.run)
        finally:
            self._held.pop(claimed.entry_id, None)
            self._tasks.pop(claimed.entry_id, None)
            self._canceled.discard(claimed.entry_id)

    async def _attempts(self, claimed: Claimed, agent: Callable[..., Any], serve: ServeClient,
                        trace_id: str) -> EpisodeOutcome | None:
        job = claimed.job
        started_ms = int(time.time() * 1000)
        while True:
            session_id = f"ep-{uuid.uuid4().hex[:24]}"
            recorded = await asyncio.to_thread(episodes.start_attempt, self.conn, job, session_id=session_id,
                                               worker_id=self.worker_id, trace_id=trace_id, started_at_ms=started_ms)
            if recorded is None:  # committed already (a leftover entry)
                await asyncio.to_thread(episodes.acknowledge, self.conn, claimed)
                return None
            episode = Episode(run=job.run, task_id=job.task_id, sample=job.sample, attempt=recorded.number,
                              session_id=session_id, base_url=serve.session_url(session_id), api_key=serve.api_key,
                              trace_id=trace_id, max_turns=job.limits.max_turns)
            reward: float | None = None
            info: dict[str, Any] = {}
            reason: str | None = None
            try:
                await serve.open_session(session_id, job.run, _metadata(job, episode), job.adapter)
                reward, info = await attempt.run(agent, job.task, episode, serve, job.limits.timeout_s)
            except EpisodeError as exc:
                reason = exc.reason
                if await asyncio.to_thread(episodes.is_canceled, self.conn, job.run, job.episode_id):
                    raise RunCanceled(job.run) from None  # its session ended with the cancel: not retried
                if exc.retry:
                    failures = await asyncio.to_thread(episodes.count_failure, self.conn, job, self.worker_id)
                    if failures <= job.limits.retries:
                        self.stats.retried += 1
                        log.info("episode %s attempt %d failed (%s); retrying in a fresh session",
                                 job.episode_id, episode.attempt, reason)
                        continue
            finally:
                await _quietly(serve.end_session(session_id, reward))
            return EpisodeOutcome(
                episode_id=job.episode_id, task_id=job.task_id, sample=job.sample,
                status="failed" if reason is not None else "finished", reward=reward, info=info, reason=reason,
                session_id=session_id, attempts=episode.attempt, turns=episode.turns, trace_id=trace_id,
                worker_id=self.worker_id, started_at_ms=started_ms, finished_at_ms=int(time.time() * 1000))


def _metadata(job: EpisodeJob, episode: Episode) -> dict[str, Any]:
    return {"episode": job.episode_id, "task_id": job.task_id, "sample": job.sample, "attempt": episode.attempt,
            "trace_id": episode.trace_id}


async def _quietly(call: Any) -> None:
    """A session bookkeeping call whose failure costs nothing the outcome holds (the reward is in it)."""
    try:
        await call
    except EpisodeError as exc:
        log.warning("%s", exc)

