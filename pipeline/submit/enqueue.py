"""Submitting requests: group them into batch jobs, stage each job's prompt ids as it fills,
and enqueue every job in one Redis transaction (all of a submit or none of it)."""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import numpy as np
import redis

from pipeline.core import adapters, rewards, settings
from pipeline.core.broker import keys, registry, reward_log
from pipeline.core.broker.redis_server import state_dir
from pipeline.core.broker.replication import Proof, replicated
from pipeline.core.broker.security import check_output_url
from pipeline.core.errors import AdapterError, PipelineError, SubmitLostError, WriteLostError
from pipeline.core.jobs.queue import PROMPTS_TTL_S, job_data, rollout_queue
from pipeline.submit import run_ids
from pipeline.submit.dataset_input import ColumnMapping, RequestColumns, dataset_blocks
from pipeline.submit.dataset_source import open_memory, open_path
from pipeline.submit.placement import Placement
from pipeline.submit.prompt_staging import PromptStager
from pipeline.submit.request_file import ParsedRequest, iter_request_blocks, open_lines
from schemas.capabilities import NO_NEEDS, Needs
from schemas.job_payload import JobHeader, JobPayload
from schemas.request import RolloutRequest

DEFAULT_BATCH_SIZE = 64
DEFAULT_JOB_TIMEOUT_S = 6 * 3600
DEFAULT_RETRIES = 2
LOST_SUBMIT_ATTEMPTS = 3  # submits lost in failovers in a row before `SubmitLostError` reaches the caller
log = logging.getLogger(__name__)
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_output() -> str:
    return settings.output() or f"file://{state_dir() / 'shards'}"


def new_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]


@dataclass(frozen=True)
class SubmitPlan:
    """What a submit enqueued: enough to wait for and read the batch back."""

    batch_id: str
    run: str
    output: str
    job_ids: list[str]
    requests: int
    samples: int
    pool: str = keys.DEFAULT_POOL
    reward: str | None = None
    groups: int | None = None  # the groups `Batch.take` keeps by default (`submit(groups=N)`)


class SubmitOptions(TypedDict, total=False):
    """The keyword options of every submit function (see `submit_blocks`)."""

    run: str | None
    output: str | None
    batch_size: int
    min_weight_version: int | None
    max_staleness: int | None
    job_timeout_s: int
    retries: int
    pool: str | None
    reward: str | None
    groups: int | None
    oversample: float | None


def submit_requests(
    conn: redis.Redis,
    requests: Sequence[RolloutRequest | ParsedRequest],
    **options: Unpack[SubmitOptions],
) -> SubmitPlan:
    """Enqueue all requests as jobs of at most `batch_size`, atomically (all or none).

    `requests` may be models or `ParsedRequest`s (`pipeline.submit.request_file.read_request_lines`),
    whose ids are packed as arrays. See `submit_blocks`.
    """
    if not requests:
        raise PipelineError("nothing to submit: no requests")
    return _resubmitting(lambda run: submit_blocks(conn, [requests], **{**options, "run": run}), options.get("run"))


def submit_file(
    conn: redis.Redis,
    path: str | Path,
    *,
    vocab_size: int | None = None,
    renderer: Callable[[str | bytes], str | bytes | dict] | None = None,
    **options: Unpack[SubmitOptions],
) -> SubmitPlan:
    """Validate every line of a JSONL file and enqueue all of it, or nothing (`RequestFileError`
    listing every bad line). Jobs are packed and their prompt ids staged while the file is still
    being read, so a large file never sits in memory whole and Redis works alongside the parse."""
    def submit(run: str) -> SubmitPlan:
        with open_lines(path) as handle:
            blocks = iter_request_blocks(handle, path=str(path), vocab_size=vocab_size, renderer=renderer)
            return submit_blocks(conn, blocks, **{**options, "run": run})

    return _resubmitting(submit, options.get("run"))


def submit_dataset(
    conn: redis.Redis,
    source: str | Path | Any,
    *,
    mapping: ColumnMapping | None = None,
    vocab_size: int | None = None,
    renderer: Callable[[Mapping[str, Any]], Any] | None = None,
    **options: Unpack[SubmitOptions],
) -> SubmitPlan:
    """Validate every row of a dataset (a path: Parquet, Arrow/Feather, a directory of Parquet, a
    `datasets.save_to_disk` directory; or a `pyarrow.Table`, `pandas.DataFrame`, `datasets.Dataset`)
    and enqueue all of it, or nothing (`DatasetError` naming rows and columns). Read and packed
    record batch by record batch, like a JSONL file line block by line block."""
    def submit(run: str) -> SubmitPlan:
        opened = open_path(source) if isinstance(source, str | Path) else open_memory(source)
        blocks = dataset_blocks(opened, mapping or ColumnMapping(), vocab_size=vocab_size, renderer=renderer)
        return submit_blocks(conn, blocks, **{**options, "run": run})

    return _resubmitting(submit, options.get("run"))


def _resubmitting(submit: Callable[[str], SubmitPlan], run: str | None) -> SubmitPlan:
    """`submit(run)`; again, into the same run, when its whole batch was lost in a Redis failover
    (`SubmitLostError`: the new master has none of it, so nothing is duplicated)."""
    run = run or new_run_name()
    attempt = 1
    while True:
        try:
            return submit(run)
        except SubmitLostError as lost:
            if attempt >= LOST_SUBMIT_ATTEMPTS:
                raise
            log.warning("%s; submitting it again (%d/%d)", lost, attempt, LOST_SUBMIT_ATTEMPTS)
            attempt += 1


def submit_blocks(
    conn: redis.Redis,
    blocks: Iterable[Sequence[RolloutRequest | ParsedRequest] | RequestColumns],
    *,
    run: str | None = None,
    output: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    min_weight_version: int | None = None,
    max_staleness: int | None = None,
    job_timeout_s: int = DEFAULT_JOB_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
    pool: str | None = None,
    reward: str | None = None,
    groups: int | None = None,
    oversample: float | None = None,
) -> SubmitPlan:
    """Enqueue the requests of `blocks` (consumed once, in order) as jobs of at most `batch_size`,
    atomically: all or none, also when `blocks` raises part-way.

    Each job's prompt ids go to their own Redis key as raw bytes (`JobPayload.pack_beside`),
    instead of base64 inside the job data (which RQ zlib-compresses, slowly and to little effect).
    They are staged as each job fills (`pipeline.submit.prompt_staging`); one MULTI/EXEC at the end,
    WATCHing the staged keys, enqueues every job and records the batch.

    Jobs go to `pool`'s queue (`pipeline.core.broker.keys.pool`). Every request is checked against each
    live worker of the pool, and requests are packed by the worker classes that can serve them
    (`pipeline.submit.placement.Placement`); each job carries what it needs in its RQ meta.

    `reward` names a registered reward function (`pipeline.core.rewards`): reward workers score every
    shard the batch commits (docs/reading.md "Rewards").

    `groups=N` enqueues only the first N requests (`oversample=F`: the first ceil(N x F)) and records
    N on the batch for `Batch.take` (docs/reading.md "Group filters and over-sampling").

    Returns once a replica has the batch (`pipeline.core.broker.replication`). `SubmitLostError` when the master
    that took it failed over before any replica had it and the new master has none of it (the
    submit functions above then submit again, once the input can be read again).
    """
    if batch_size < 1:
        raise PipelineError(f"--batch-size must be at least 1, not {batch_size}")
    if max_staleness is not None and max_staleness < 0:
        raise PipelineError(f"--max-staleness must be 0 or more weight versions, not {max_staleness}")
    run = run or new_run_name()
    if not _RUN_NAME.match(run):
        raise PipelineError(
            f"run name {run!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it becomes a directory name)"
        )
    if reward is not None:
        rewards.check_registered(reward)
    limit = _request_limit(groups, oversample)
    if limit is not None:
        blocks = _first(blocks, limit)
    output = (output or default_output()).rstrip("/")
    check_output_url(output)  # the default output too: a worker would refuse it anyway
    where = keys.pool(pool)
    workers = registry.live_workers(conn, where.name)
    jobs = _Jobs(run=run, batch_id=uuid.uuid4().hex[:12], output=output, submitted_at_ms=int(time.time() * 1000),
                 min_weight_version=min_weight_version, max_staleness=max_staleness, job_timeout_s=job_timeout_s,
                 retries=retries, adapters=AdapterCheck(conn, where.name))
    stager = PromptStager(conn)
    try:
        # Requests the same worker classes can serve share jobs (`pipeline.submit.placement`).
        packer = _Packer(jobs, stager, Placement(workers, where.name), batch_size)
        for block in blocks:
            if isinstance(block, RequestColumns):
                packer.columns(block)
            else:
                packer.block(block)
        packer.finish()
        if not jobs.job_ids:
            raise PipelineError("nothing to submit: no requests")
        if limit is not None and jobs.requests < limit:
            raise PipelineError(f"groups={groups} with oversample={oversample or 1:g} needs {limit} requests; the "
                                f"input has {jobs.requests}; nothing was enqueued")
        if reward is not None:
            reward_log.ensure_group(conn, run)
        with conn.pipeline(transaction=True) as pipe:
            stager.confirm(pipe)
            request_ids = run_ids.encode(jobs.request_ids)
            run_ids.refuse_taken(pipe, run, request_ids)
            pipe.multi()
            for key in stager.keys:
                pipe.expire(key, PROMPTS_TTL_S)
            rollout_queue(conn, where.name).enqueue_many(jobs.datas, pipeline=pipe)
            pipe.hset(
                keys.batch(jobs.batch_id),
                mapping={
                    "run": run,
                    "output": output,
                    "pool": where.name,
                    "job_ids": ",".join(jobs.job_ids),
                    "requests": jobs.requests,
                    "samples": jobs.samples,
                    "submitted_at_ms": jobs.submitted_at_ms,
                    **({"reward": reward} if reward is not None else {}),
                    **({"groups": groups} if groups is not None else {}),
                },
            )
            if reward is not None:
                pipe.sadd(keys.REWARD_RUNS, run)
            pipe.sadd(keys.run_batches(run), jobs.batch_id)
            run_ids.add(pipe, run, request_ids)
            pipe.sadd(where.open_batches, jobs.batch_id)
            pipe.sadd(where.runs, run)
            pipe.sadd(keys.POOLS, where.name)
            try:
                pipe.execute()
            except redis.WatchError:
                # redis-py also says WatchError when the connection died under the EXEC, which may
                # have gone through: the batch's record says whether it did.
                if not conn.exists(keys.batch(jobs.batch_id)):
                    raise PipelineError(f"staged prompt ids, or the request ids of run {run!r} (another submit "
                                        "into it at the same time), changed in Redis before the jobs were "
                                        "enqueued; nothing was enqueued, submit again") from None
    except BaseException:
        stager.discard()
        raise
    finally:
        stager.close()
    try:
        replicated(conn, f"batch {jobs.batch_id} of run {run!r} (its {len(jobs.job_ids)} jobs)",
                   Proof(("EXISTS", keys.batch(jobs.batch_id))))
    except WriteLostError:
        raise SubmitLostError(jobs.batch_id, run) from None
    return SubmitPlan(jobs.batch_id, run, output, jobs.job_ids, jobs.requests, jobs.samples, where.name, reward,
                      groups)


def _request_limit(groups: int | None, oversample: float | None) -> int | None:
    """How many requests a submit with `groups` and `oversample` enqueues (None: all)."""
    if oversample is not None and groups is None:
        raise PipelineError("--oversample F needs --groups N: it submits ceil(N x F) requests")
    if groups is None:
        return None
    if groups < 1:
        raise PipelineError(f"--groups must be at least 1, not {groups}")
    if oversample is not None and not (math.isfinite(oversample) and oversample >= 1):
        raise PipelineError(f"--oversample must be a number >= 1, not {oversample}")
    return math.ceil(groups * (oversample or 1) - 1e-9)


def _first(blocks: Iterable[Sequence[Any]], limit: int) -> Iterator[Sequence[Any]]:
    """The blocks' first `limit` requests."""
    left = limit
    for block in blocks:
        if left <= 0:
            return
        yield block[:left]
        left -= len(block)


@dataclass
class _Group:
    """Requests waiting to fill a job, and what they need of its worker together."""

    requests: list[RolloutRequest | ParsedRequest] = field(default_factory=list)
    needs: Needs = NO_NEEDS


@dataclass
class _Packer:
    """Blocks of requests into jobs: each job key's open job (`pipeline.submit.placement`) fills to
    `batch_size`, then is packed; `finish` packs the ones left open."""

    jobs: _Jobs
    stager: PromptStager
    placement: Placement
    batch_size: int
    pending: dict[Hashable, _Group] = field(default_factory=dict)

    def block(self, block: Sequence[RolloutRequest | ParsedRequest]) -> None:
        """A block of requests, placed together (`Placement.place_block`)."""
        placed = self.placement.place_block(block)
        self.placement.check()
        for key, needs, requests in placed:
            self._add(key, needs, requests)

    def columns(self, block: RequestColumns) -> None:
        """A columnar block (rows asking the same of a worker): placed once, with its largest token id;
        whole jobs packed straight from its arrays; the open job's remainder and the block's tail
        joined as single requests."""
        row = block.largest_row()  # a token id outside a vocabulary is named by its row
        needs, key = self.placement.place(block.stand_in, block.ids[row], block.first + row)
        self.placement.check()
        start = 0
        if key in self.pending:
            start = min(len(block), self.batch_size - len(self.pending[key].requests))
            self._add(key, needs, block.requests(0, start))
        while len(block) - start >= self.batch_size:
            self.jobs.add_columns(block, start, start + self.batch_size, self.stager, needs)
            start += self.batch_size
        if start < len(block):
            self._add(key, needs, block.requests(start, len(block)))

    def finish(self) -> None:
        for group in self.pending.values():
            self._pack(group)
        self.pending.clear()

    def _add(self, key: Hashable, needs: Needs, requests: Sequence[RolloutRequest | ParsedRequest]) -> None:
        """Requests of one job key (asking `needs` together) into its open job, in slices."""
        start = 0
        while start < len(requests):
            group = self.pending.setdefault(key, _Group())
            end = start + self.batch_size - len(group.requests)
            group.requests.extend(requests[start:end])
            group.needs |= needs
            if len(group.requests) >= self.batch_size:
                self._pack(self.pending.pop(key))
            start = end

    def _pack(self, group: _Group) -> None:
        self.jobs.add(group.requests, self.stager, self.placement.job_needs(group.needs, group.requests))


@dataclass
class AdapterCheck:
    """The adapters a submit's requests name, checked against the pool's (read once, at the first)."""

    conn: redis.Redis
    pool: str
    known: set[str] | None = None

    def check(self, job_fields: Sequence[Mapping[str, Any]]) -> None:
        """`AdapterError` for a request naming an adapter never pushed to the pool."""
        for fields in job_fields:
            name = fields.get("adapter")
            if name is None:
                continue
            if self.known is None:
                self.known = set(adapters.records(self.conn, self.pool))
            if name not in self.known:
                raise AdapterError(f"request {fields.get('id')!r}: {adapters.unknown(name, self.known, self.pool)}; "
                                   "nothing was enqueued")


@dataclass
class _Jobs:
    """The jobs of one submit as they fill: RQ job data, ids, counts; prompt ids staged as each is packed."""

    run: str
    batch_id: str
    output: str
    submitted_at_ms: int
    min_weight_version: int | None
    max_staleness: int | None
    job_timeout_s: int
    retries: int
    # The pool's adapters (`pipeline.core.adapters`): a request naming another is refused, nothing enqueued.
    adapters: AdapterCheck
    datas: list[Any] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    requests: int = 0
    samples: int = 0
    _seen: set[str] = field(default_factory=set)

    @property
    def request_ids(self) -> list[str]:
        """Every request id packed so far."""
        return list(self._seen)

    def add(self, chunk: Sequence[RolloutRequest | ParsedRequest], stager: PromptStager, needs: Needs) -> None:
        self._unique([request.id for request in chunk])
        job_id, header = self._next()
        payload, prompt_bytes = JobPayload.pack_beside(chunk, prompt_key=keys.prompts(job_id), **header)
        samples = sum(r.n if isinstance(r, ParsedRequest) else r.sampling_params.n for r in chunk)
        self._enqueue(job_id, payload, prompt_bytes, samples, stager, needs)

    def add_columns(self, block: RequestColumns, start: int, end: int, stager: PromptStager, needs: Needs) -> None:
        """Rows `start:end` of a columnar block as one job: their ids copied once from its array."""
        self._unique(block.ids[start:end])
        job_id, header = self._next()
        offsets = block.offsets[start : end + 1]
        payload, prompt_bytes = JobPayload.pack_flat(
            block.job_fields[start:end], block.flat[offsets[0] : offsets[-1]], np.diff(offsets).tolist(),
            prompt_key=keys.prompts(job_id), **header)
        self._enqueue(job_id, payload, prompt_bytes, block.n * (end - start), stager, needs)

    def _unique(self, ids: list[str]) -> None:
        fresh = set(ids)
        if len(fresh) != len(ids) or not self._seen.isdisjoint(fresh):
            this_job: set[str] = set()
            for request_id in ids:  # the first id seen before, in an earlier job or earlier in this one
                if request_id in self._seen or request_id in this_job:
                    raise PipelineError(f"request id {request_id!r} appears twice; ids must be unique within a "
                                        "submit")
                this_job.add(request_id)
        self._seen.update(fresh)

    def _next(self) -> tuple[str, JobHeader]:
        job_id = f"{self.batch_id}-{len(self.job_ids):05d}"
        return job_id, JobHeader(run=self.run, job_id=job_id, batch_id=self.batch_id, output=self.output,
                                 submitted_at_ms=self.submitted_at_ms, min_weight_version=self.min_weight_version,
                                 max_staleness=self.max_staleness)

    def _enqueue(self, job_id: str, payload: JobPayload, prompt_bytes: bytes, samples: int, stager: PromptStager,
                 needs: Needs) -> None:
        self.adapters.check(payload.requests)
        index = len(self.job_ids)
        stager.stage(keys.prompts(job_id), prompt_bytes)
        self.job_ids.append(job_id)
        self.requests += len(payload.requests)
        self.samples += samples
        self.datas.append(
            job_data(payload, timeout_s=self.job_timeout_s, retries=self.retries, needs=needs,
                     description=f"rollouts run={self.run} job={index} requests={len(payload.requests)}",
                     meta={"batch_id": self.batch_id})
        )
