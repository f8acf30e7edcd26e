"""Submitting agent episodes: a tasks file (or dataset, or list of dicts) in, one episode job per
task × sample enqueued, all or nothing.

Every task is read and checked before anything is enqueued (a line that is not a JSON object, an
`id` that is not a short name or integer, an id given twice: each named by line and field), the
agent path imported, the run's ids checked unique; then every job goes into its
pool's stream for that agent in one WATCHed MULTI/EXEC (`pipeline.core.jobs.episodes`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from pipeline.core import agents
from pipeline.core.adapters import check_known
from pipeline.core.broker import control_channel, keys
from pipeline.core.errors import REQUESTS, AdapterError, LineError, PipelineError, RequestFileError
from pipeline.core.jobs import episodes
from pipeline.submit import run_ids
from pipeline.submit.dataset_source import is_dataset_path, open_path
from pipeline.submit.request_file import open_lines
from schemas.episode import TASK_ID, EpisodeJob, EpisodeLimits, episode_id

MAX_SAMPLES = 1024
_RUN_TTL_S = 30 * 24 * 3600  # a run's episode records outlive any episode still queued this long


@dataclass(frozen=True)
class Task:
    task_id: str
    data: dict[str, Any]


@dataclass(frozen=True)
class EpisodePlan:
    """What an episode submit enqueued."""

    run: str
    pool: str
    agent: str
    tasks: list[str]
    n: int
    episodes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "episodes", len(self.tasks) * self.n)


def _task_id(value: Any, fallback: str) -> str | None:
    if value is None:
        return fallback
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    text = str(value)
    return text if TASK_ID.match(text) else None


def read_tasks(source: str | Path | Iterable[Mapping[str, Any]]) -> list[Task]:
    """The tasks of a JSONL file, a dataset on disk, or an iterable of dicts; all valid, or
    `RequestFileError` locating every bad line. A task without `id` is named by its line (`L7`) or
    position (`7`)."""
    if isinstance(source, str | Path):
        path = str(source)
        if is_dataset_path(path):
            dataset = open_path(path)
            rows = (row for batch in dataset.read(list(dataset.schema.names)) for row in batch.to_pylist())
            return _checked(path, ((i, row, None) for i, row in enumerate(rows)), what="row")
        if not Path(path).is_file():
            raise PipelineError(f"{path}: no such tasks file (a JSONL file of task objects, or a dataset)")
        with open_lines(path) as handle:
            return _checked(path, _jsonl(handle), what="line")
    return _checked(REQUESTS, ((i, row, None) for i, row in enumerate(source)), what="entry")


def _jsonl(handle: Any) -> Iterable[tuple[int, Any, str | None]]:
    for number, raw in enumerate(handle, start=1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw), None
        except ValueError as exc:
            yield number, None, f"not JSON ({exc})"


def _checked(path: str, rows: Iterable[tuple[int, Any, str | None]], *, what: str) -> list[Task]:
    tasks: list[Task] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    total = 0
    for number, row, problem in rows:
        total += 1
        if problem is not None:
            errors.append(LineError(path, number, "", problem))
            continue
        if not isinstance(row, dict):
            errors.append(LineError(path, number, "", f"a task is a JSON object, not {type(row).__name__}"))
            continue
        fallback = f"L{number}" if what == "line" else str(number)
        task_id = _task_id(row.get("id"), fallback)
        if task_id is None:
            errors.append(LineError(path, number, "id", f"{row.get('id')!r} is not a task id (a string of "
                                    "letters, digits, '.', '_' or '-', at most 128, or an integer)"))
            continue
        if task_id in seen:
            errors.append(LineError(path, number, "id", f"{task_id!r} is also the id of {what} {seen[task_id]}; "
                                    "task ids are unique in a submit"))
            continue
        seen[task_id] = number
        tasks.append(Task(task_id, row))
    if errors:
        raise RequestFileError(path, errors, total)
    if not tasks:
        raise PipelineError(f"{path}: no tasks (every {what} was empty); nothing was enqueued")
    return tasks


def submit_episodes(conn: redis.Redis, tasks: list[Task], *, agent: str, run: str, pool: str | None = None,
                    n: int = 1, limits: EpisodeLimits | None = None,
                    failed_reward: float | None = None, max_staleness: int | None = None,
                    groups_per_step: int | None = None, adapter: str | None = None) -> EpisodePlan:
    """Enqueue one episode job per task × sample, all or nothing (see the module docstring).

    `failed_reward`: failed episodes are read into training with this reward (default: left out).
    `max_staleness` K with `groups_per_step` B: the tasks of training step s (the s-th B tasks) start
    only once the trainer has pushed the version K steps before it (`pipeline.core.jobs.admission`).
    `adapter`: every turn of every episode runs on this LoRA adapter of the pool (refused if unknown)."""
    if not 1 <= n <= MAX_SAMPLES:
        raise PipelineError(f"--n {n}: samples per task are 1 to {MAX_SAMPLES}; nothing was enqueued")
    if failed_reward is not None and not math.isfinite(failed_reward):
        raise PipelineError(f"--failed-reward {failed_reward}: a finite number; nothing was enqueued")
    if (max_staleness is None) != (groups_per_step is None):
        raise PipelineError("--max-staleness K needs --groups-per-step B (the tasks a training step takes), and "
                            "the other way round; nothing was enqueued")
    if max_staleness is not None and (max_staleness < 0 or groups_per_step < 1):  # type: ignore[operator]
        raise PipelineError("--max-staleness is 0 or more and --groups-per-step 1 or more; nothing was enqueued")
    agents.load(agent)
    where = keys.pool(pool)
    if adapter is not None:
        try:
            check_known(conn, where.name, adapter)
        except AdapterError as exc:
            raise AdapterError(f"--adapter {adapter}: {exc}; nothing was enqueued") from None
    limits = limits or EpisodeLimits()
    now_ms = int(time.time() * 1000)
    jobs = [EpisodeJob(run=run, pool=where.name, agent=agent, task_id=task.task_id,
                       sample=sample, group_size=n, group_index=index, task=task.data, limits=limits,
                       submitted_at_ms=now_ms, adapter=adapter)
            for index, task in enumerate(tasks) for sample in range(n)]
    try:
        base_version = control_channel.read_state(conn, where.name).weight_version
    except PipelineError:
        base_version = None
    spec = {"agent": agent, "pool": where.name, "n": n,
            "tasks": [t.task_id for t in tasks], "limits": limits.model_dump(), "failed_reward": failed_reward,
            "max_staleness": max_staleness, "groups_per_step": groups_per_step,
            "base_version": base_version or 0, "submitted_at_ms": now_ms, "adapter": adapter}
    stream = where.episode_stream(agent)
    episodes.STREAMS.ensure_group(conn, stream)
    ids = run_ids.encode([episode_id(t.task_id, s) for t in tasks for s in range(n)])
    run_key = keys.episode_run(run)
    while True:
        with conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(run_key)
                run_ids.refuse_taken(pipe, run, ids)
                if pipe.exists(run_key):
                    earlier = json.loads(pipe.hget(run_key, "spec") or b"{}")
                    if earlier.get("agent") != agent or earlier.get("pool") != where.name:
                        raise PipelineError(f"run {run!r} runs agent {earlier.get('agent')!r} in pool "
                                            f"{earlier.get('pool')!r}; submit these tasks into another run")
                    spec["tasks"] = earlier["tasks"] + spec["tasks"]
                pipe.multi()
                run_ids.add(pipe, run, ids)
                pipe.hset(run_key, "spec", json.dumps(spec))
                pipe.hincrby(run_key, "submitted", len(jobs))
                pipe.expire(run_key, _RUN_TTL_S)
                pipe.sadd(keys.EPISODE_RUNS, run)
                pipe.sadd(where.runs, run)
                pipe.sadd(keys.POOLS, where.name)
                pipe.sadd(where.episode_agents, agent)
                for job in jobs:
                    episodes.STREAMS.add(pipe, stream, job.model_dump_json())
                pipe.execute()
                break
            except redis.WatchError:
                continue
    return EpisodePlan(run, where.name, agent, [t.task_id for t in tasks], n)
