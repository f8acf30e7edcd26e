"""`pipeline reward-worker`: CPU workers scoring committed rollout shards with the run's reward function.

Every run submitted with `--reward NAME` gets a consumer group on its commit log
(`pipeline.core.broker.keys.REWARD_GROUP`); reward workers read it with `XREADGROUP`, so each commit goes to
one worker and any number of them share the work. For each commit of a batch with a reward
function the worker reads the shard's rows, calls the function on them `batch_rows` at a time,
writes `<job id>.rewards.parquet` beside the shard (atomically, as shards are written), appends
to the run's rewards stream (`pipeline.core.broker.reward_log`, once per job) and acknowledges the entry.

Exactly once per row: a worker that dies before acknowledging leaves the entry pending; another
worker claims it after `claim_after_s` (`XAUTOCLAIM`), scores the shard again (the same rows, the
same file, rewritten whole) and appends, which is a no-op if the first worker had appended. A
job whose rewards are recorded is never scored again (a retried job's second commit included).

A reward function that raises, returns the wrong shape, or is not registered on this worker
records the job's rewards as failed with that error; the rollouts stay. A storage failure leaves
the entry pending for a later attempt.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import redis

from pipeline.core import rewards
from pipeline.core.broker import keys, reward_log
from pipeline.core.broker.commit_log import Commit
from pipeline.core.shards import read_rollouts
from schemas.shard import REWARDS_SCHEMA, rewards_path
from workers.errors import ShardWriteError
from workers.process.metrics import RewardMetrics
from workers.rows.shard_writer import PendingShard, encode

log = logging.getLogger(__name__)

DEFAULT_BATCH_ROWS = 256
DEFAULT_CLAIM_AFTER_S = 60.0
DEFAULT_BLOCK_MS = 1000
_READ_COUNT = 16
_COLUMNS = ["rollout_id", "request_id", "sample_index", "completion_text", "completion_token_ids",
            "finish_reason", "metadata"]


@dataclass(frozen=True)
class Scored:
    """One shard's rewards: the table, their sum, its groups and those whose rewards are all equal."""

    table: pa.Table
    total: float
    groups: int
    equal_groups: int


def score(name: str, function: rewards.RewardFunction, shard_url: str, batch_rows: int) -> Scored:
    """The rewards of one rollout shard."""
    table = read_rollouts(shard_url, columns=_COLUMNS)
    rows = table.to_pylist()
    for row in rows:
        row["metadata"] = json.loads(row["metadata"]) if row["metadata"] else {}
    ids: list[str] = []
    values: list[float] = []
    infos: list[str | None] = []
    for start in range(0, len(rows), batch_rows):
        chunk = rows[start : start + batch_rows]
        for row, (reward, info) in zip(chunk, rewards.normalise(name, len(chunk), function(chunk)), strict=True):
            ids.append(row["rollout_id"])
            values.append(reward)
            infos.append(json.dumps(dict(info), default=str) if info is not None else None)
    out = pa.Table.from_arrays([pa.array(ids, pa.string()), pa.array(values, pa.float64()),
                                pa.array(infos, pa.string())], schema=REWARDS_SCHEMA)
    by_group: dict[str, set[float]] = {}
    for row, value in zip(rows, values, strict=True):
        by_group.setdefault(row["request_id"], set()).add(value)
    return Scored(out, float(sum(values)), len(by_group), sum(len(v) == 1 for v in by_group.values()))


class RewardWorker:
    """One reward worker: reads every reward run's commit log through the shared consumer group."""

    def __init__(self, conn: redis.Redis, *, worker_id: str | None = None, batch_rows: int = DEFAULT_BATCH_ROWS,
                 claim_after_s: float = DEFAULT_CLAIM_AFTER_S, block_ms: int = DEFAULT_BLOCK_MS) -> None:
        self.conn = conn
        self.worker_id = worker_id or f"rewards-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.batch_rows = max(1, batch_rows)
        self.claim_after_ms = int(claim_after_s * 1000)
        self.block_ms = max(1, block_ms)
        self.stop = threading.Event()
        self.scored = 0  # jobs whose rewards this worker recorded (failures included)
        self.metrics = RewardMetrics(self.worker_id)
        self._reward_of: dict[str, str | None] = {}

    def work(self, *, burst: bool = False) -> int:
        """Score commits until stopped (or, with `burst`, until nothing is left); jobs recorded."""
        while not self.stop.is_set():
            runs = sorted(r.decode() for r in self.conn.smembers(keys.REWARD_RUNS))
            try:
                claimed = sum(self._claim(run) for run in runs)
                read = self._read(runs, block=not burst and not claimed)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # A run's commit log was deleted (and with it the group): start it again, empty.
                log.warning("reward runs without their consumer group (%s); recreating it", exc)
                for run in runs:
                    reward_log.ensure_group(self.conn, run)
                continue
            if burst and not claimed and not read:
                break
        return self.scored

    def _claim(self, run: str) -> int:
        """Entries other (dead) workers took and did not acknowledge within `claim_after_s`."""
        reply = self.conn.xautoclaim(keys.commit_log(run), keys.REWARD_GROUP, self.worker_id,
                                     min_idle_time=self.claim_after_ms, start_id="0-0", count=_READ_COUNT)
        entries = reply[1] if reply else []
        for entry_id, fields in entries:
            if fields:  # a claimed entry whose stream entry was trimmed has none
                self._handle(run, entry_id.decode(), fields)
        return len(entries)

    def _read(self, runs: list[str], *, block: bool) -> int:
        if not runs:
            if block:
                self.stop.wait(self.block_ms / 1000)
            return 0
        streams = {keys.commit_log(run): ">" for run in runs}
        reply = self.conn.xreadgroup(keys.REWARD_GROUP, self.worker_id, streams, count=_READ_COUNT,
                                     block=self.block_ms if block else None)
        handled = 0
        for stream, entries in reply or []:
            run = stream.decode().removeprefix(keys.commit_log(""))
            for entry_id, fields in entries:
                self._handle(run, entry_id.decode(), fields)
                handled += 1
        return handled

    def _reward(self, batch_id: str) -> str | None:
        if batch_id not in self._reward_of:
            raw = self.conn.hget(keys.batch(batch_id), "reward")
            self._reward_of[batch_id] = raw.decode() if raw is not None else None
        return self._reward_of[batch_id]

    def _handle(self, run: str, entry_id: str, fields: dict[bytes, Any]) -> None:
        commit = Commit.from_fields(entry_id, fields)
        name = self._reward(commit.batch_id)
        if name is not None and not self.conn.hexists(keys.reward_jobs(run), commit.job_id):
            try:
                self._score(run, commit, name)
            except ShardWriteError as exc:  # storage: leave the entry pending for a later attempt
                log.warning("rewards of job %s not written (%s); another attempt after %.0f s",
                            commit.job_id, exc, self.claim_after_ms / 1000)
                return
        self.conn.xack(keys.commit_log(run), keys.REWARD_GROUP, entry_id)

    def _score(self, run: str, commit: Commit, name: str) -> None:
        url = rewards_path(commit.url)
        started = time.monotonic()
        try:
            function = rewards.resolve(name)
            scored = score(name, function, commit.url, self.batch_rows)
        except Exception as exc:  # the function's (or its name's) fault: the job's rewards fail, rollouts stay
            error = f"{type(exc).__name__}: {exc}"
            log.error("rewards of job %s (run %s, reward %s) failed: %s", commit.job_id, run, name, error)
            if reward_log.append(self.conn, run, reward_log.RewardCommit(commit.job_id, "", 0, error=error)):
                self.scored += 1
                self.metrics.failed()
            return
        rows = scored.table.num_rows
        PendingShard(url, encode(scored.table)).store()
        if reward_log.append(self.conn, run, reward_log.RewardCommit(commit.job_id, url, rows), scored.total,
                             scored.groups, scored.equal_groups):
            self.scored += 1
            self.metrics.scored(rows, time.monotonic() - started)
            log.info("rewards of job %s: %d rows, mean %.4g", commit.job_id, rows,
                     scored.total / rows if rows else float("nan"))
