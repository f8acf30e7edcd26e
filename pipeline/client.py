"""The trainer's Python API: connect, submit, wait, read; pause, resume, push weights.

A client works in one pool (`connect(pool=...)`, else `$PIPELINE_POOL`, else `default`); every
pool-scoped call also takes `pool=` to address another one for that call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import redis
from pydantic import ValidationError

from pipeline.core import adapters as adapter_registry
from pipeline.core.broker import control_channel, keys, registry
from pipeline.core.broker.connection import connect_redis
from pipeline.core.errors import REQUESTS, LineError, PipelineError, RequestFileError
from pipeline.read.follow import DEFAULT_BLOCK_MS, Follower
from pipeline.runs.batch import Batch
from pipeline.runs.cancel import CancelResult, cancel
from pipeline.runs.episodes import EpisodeRun
from pipeline.submit.dataset_input import ColumnMapping
from pipeline.submit.dataset_source import is_dataset_path
from pipeline.submit.enqueue import DEFAULT_BATCH_SIZE, SubmitOptions, submit_dataset, submit_file, submit_requests
from pipeline.submit.episodes import read_tasks, submit_episodes
from pipeline.submit.request_file import ParsedRequest, validation_errors, with_sampling_defaults
from pipeline.weights.adapter_push import AdapterPushResult
from schemas.adapters import AdapterRecord
from schemas.control import DesiredState, SwapMode
from schemas.episode import DEFAULT_EPISODE_RETRIES, DEFAULT_EPISODE_TIMEOUT_S, EpisodeLimits
from schemas.request import RolloutRequest
from schemas.worker_info import WorkerInfo


def _as_requests(
    requests: Sequence[RolloutRequest | ParsedRequest | Mapping[str, Any]],
) -> list[RolloutRequest | ParsedRequest]:
    """Models and lines already validated by `pipeline.submit.request_file` pass; dicts are validated here."""
    parsed: list[RolloutRequest | ParsedRequest] = []
    errors: list[LineError] = []
    for index, item in enumerate(requests):
        if isinstance(item, RolloutRequest | ParsedRequest):
            parsed.append(item)
            continue
        try:
            parsed.append(RolloutRequest.model_validate(item))
        except ValidationError as exc:
            errors.extend(validation_errors(REQUESTS, index, exc))
    if errors:
        raise RequestFileError(REQUESTS, errors, len(requests))
    return parsed


def _renderer(tokenizer: Any) -> Any:
    """`ChatRenderer.render_line` of a tokenizer (a path, a transformers tokenizer or a renderer); None without."""
    if tokenizer is None:
        return None
    from pipeline.submit.render import ChatRenderer

    return (tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)).render_line


class Client:
    """A connection to the pipeline's Redis, working in `pool`."""

    def __init__(self, conn: redis.Redis, pool: str | None = None) -> None:
        self.conn = conn
        self.pool = keys.pool_name(pool)

    def _pool(self, pool: str | None) -> str:
        return keys.pool_name(pool) if pool else self.pool

    def submit(
        self,
        requests: Sequence[RolloutRequest | ParsedRequest | Mapping[str, Any]] | Any,
        *,
        run: str | None = None,
        output: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        min_weight_version: int | None = None,
        max_staleness: int | None = None,
        tokenizer: Any = None,
        pool: str | None = None,
        columns: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        sampling: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
        reward: str | None = None,
        groups: int | None = None,
        oversample: float | None = None,
    ) -> Batch:
        """Validate and enqueue requests (dicts or models), or every row of a `pyarrow.Table`,
        `pandas.DataFrame` or `datasets.Dataset`; all or nothing.

        `reward`: a registered reward function (`pipeline.core.rewards`) that reward workers run on every
        shard of the batch (docs/reading.md "Rewards"). `groups=N` (with `oversample=F`) submits only the first
        N (ceil(N x F)) requests, for `batch.take()` (docs/reading.md "Group filters and over-sampling").

        `max_staleness=K`: no committed sample holds a token from a weight version more than K
        behind the version its worker serves at commit (docs/control.md "Staleness bound").

        With `tokenizer` (a path, a transformers tokenizer or a `pipeline.submit.render.ChatRenderer`), dicts
        carrying `messages` or `prompt` are rendered into token ids first, as SGLang's chat endpoint would.

        For a table: `columns` maps request fields to columns (`{"input_ids": "prompt_ids"}`, dotted
        paths into structs), `metadata` metadata keys to columns, `sampling` gives every row's default
        sampling parameters (`pipeline.submit.dataset_input.ColumnMapping`); rows failing validation raise
        `DatasetError` naming their 0-based index and column.
        """
        options: SubmitOptions = {"run": run, "output": output, "batch_size": batch_size,
                                  "min_weight_version": min_weight_version, "max_staleness": max_staleness,
                                  "pool": self._pool(pool), "reward": reward, "groups": groups,
                                  "oversample": oversample}
        if not isinstance(requests, list | tuple):
            mapping = ColumnMapping(columns or {}, metadata or {}, sampling or {})
            plan = submit_dataset(self.conn, requests, mapping=mapping, vocab_size=vocab_size,
                                  renderer=_renderer(tokenizer), **options)
            return Batch(self.conn, plan)
        if columns or metadata or sampling:
            raise PipelineError("columns=, metadata= and sampling= map the columns of a table; "
                                "a list of request dicts carries its fields itself")
        if tokenizer is not None:
            from pipeline.submit.render import render_requests

            requests = render_requests(requests, tokenizer)
        plan = submit_requests(self.conn, _as_requests(requests), **options)
        return Batch(self.conn, plan)

    def submit_file(
        self, path: str, *, tokenizer: Any = None, vocab_size: int | None = None,
        columns: Mapping[str, str] | None = None, metadata: Mapping[str, str] | None = None,
        sampling: Mapping[str, Any] | None = None, **options: Unpack[SubmitOptions]
    ) -> Batch:
        """Validate every line of a JSONL file (chat lines rendered with `tokenizer`) and enqueue all
        of it, or nothing (`RequestFileError` listing every bad line); see `pipeline.submit.enqueue.submit_file`.

        A dataset path (Parquet, Arrow/Feather, a directory of Parquet or of `datasets.save_to_disk`;
        `pipeline.submit.dataset_source.is_dataset_path`) is read by column instead, mapped by `columns`,
        `metadata` and `sampling` as in `submit` (`pipeline.submit.enqueue.submit_dataset`). For a JSONL
        file, `sampling` gives every line the sampling parameters its `sampling_params` does not set."""
        renderer = _renderer(tokenizer)
        options["pool"] = self._pool(options.get("pool"))
        if is_dataset_path(path):
            mapping = ColumnMapping(columns or {}, metadata or {}, sampling or {})
            plan = submit_dataset(self.conn, path, mapping=mapping, vocab_size=vocab_size, renderer=renderer,
                                  **options)
            return Batch(self.conn, plan)
        if columns or metadata:
            raise PipelineError(f"{path}: a column mapping applies to datasets (Parquet, Arrow, Feather, a "
                                "directory), not to JSONL lines, which name their fields")
        if sampling:  # defaults for the lines' sampling_params (a line's own values win)
            renderer = with_sampling_defaults(sampling, renderer)
        return Batch(self.conn, submit_file(self.conn, path, vocab_size=vocab_size, renderer=renderer, **options))

    def submit_episodes(
        self, tasks: str | Sequence[Mapping[str, Any]], *, agent: str, run: str | None = None, n: int = 1,
        timeout_s: float | None = DEFAULT_EPISODE_TIMEOUT_S, max_turns: int | None = None,
        retries: int = DEFAULT_EPISODE_RETRIES, failed_reward: float | None = None, max_staleness: int | None = None,
        groups_per_step: int | None = None, pool: str | None = None, adapter: str | None = None,
    ) -> EpisodeRun:
        """Enqueue one agent episode per task × sample (`n`), all or nothing: `tasks` a JSONL file, a
        dataset or a list of dicts; `agent` the `package.module:function` agent workers run
        (`pipeline agent-worker --agent ...`), imported here first; `adapter` a LoRA adapter of the pool
        every turn runs on. See `pipeline.submit.episodes`."""
        from pipeline.submit.enqueue import new_run_name

        plan = submit_episodes(self.conn, read_tasks(tasks), agent=agent, run=run or new_run_name(),
                               pool=self._pool(pool), n=n,
                               limits=EpisodeLimits(timeout_s=timeout_s, max_turns=max_turns, retries=retries),
                               failed_reward=failed_reward, max_staleness=max_staleness,
                               groups_per_step=groups_per_step, adapter=adapter)
        return EpisodeRun(self.conn, plan)

    def workers(self, *, pool: str | None = None) -> list[WorkerInfo]:
        return registry.live_workers(self.conn, self._pool(pool))

    def pools(self) -> list[str]:
        """Every pool named so far on this Redis, `default` first."""
        return registry.pools(self.conn)

    def pause(self, *, pool: str | None = None) -> DesiredState:
        """The pool's workers finish the batch in hand and take no new job until `resume()`."""
        return control_channel.pause(self.conn, self._pool(pool))

    def resume(self, *, pool: str | None = None) -> DesiredState:
        return control_channel.resume(self.conn, self._pool(pool))

    def control_state(self, *, pool: str | None = None) -> DesiredState:
        return control_channel.read_state(self.conn, self._pool(pool))

    def push_weights(
        self,
        path: str | None = None,
        *,
        version: int,
        state_dict: Mapping[str, Any] | None = None,
        store: str | None = None,
        delta: bool = True,
        dtype: Any = None,
        full_every: int | None = None,
        timeout: float | None = control_channel.DEFAULT_PUSH_TIMEOUT_S,
        force: bool = False,
        mode: SwapMode = "drain",
        pool: str | None = None,
    ) -> control_channel.PushResult:
        """Every worker of the pool loads new weights as `version`; returns when all its live workers acked.
        Other pools' workers are neither paused nor reloaded.

        `path`: a checkpoint directory every worker reloads. `state_dict` (a trainer's
        `model.state_dict()`, torch tensors on any device; floating ones cast to `dtype` when given):
        written to a versioned weight store (`store`, an fsspec URL; default
        `<PIPELINE_HOME>/weights/<pool>`) as a delta against the version before, which workers
        apply in place and check bit for bit (docs/control.md "Pushes from memory"). A `path`
        with `store` goes through the store too. `delta=False` writes a full version; the store
        writes one anyway every `full_every` versions. The result (`StorePushResult` for a store
        push) says what was stored; each ack says how its worker loaded and the bytes it read.

        `mode="drain"` (default) swaps between batches; `mode="partial"` stops the samples in
        flight, loads, and continues them on the new weights (docs/control.md "Swapping weights: drain or partial").

        Raises `WeightVersionError` for a version not newer than the current one (unless
        `force`) and `WeightPushError` naming the workers that failed or timed out.
        """
        if (path is None) == (state_dict is None):
            raise PipelineError("push_weights takes a checkpoint path or a state_dict (one of them)")
        if state_dict is None and store is None:
            if dtype is not None or full_every is not None:
                raise PipelineError("dtype= and full_every= apply to pushes through a weight store (state_dict= "
                                    "or store=)")
            return control_channel.push_weights(self.conn, str(path), version, timeout=timeout, force=force,
                                                mode=mode, pool=self._pool(pool))
        from pipeline.weights.push import push_via_store
        from pipeline.weights.writer import DEFAULT_FULL_EVERY

        if state_dict is not None:
            from pipeline.core.weights.torch_bits import state_dict_bits

            tensors = state_dict_bits(state_dict, dtype)
        else:
            if dtype is not None:
                raise PipelineError("dtype= casts a state_dict; a checkpoint is stored with its own dtypes")
            from pipeline.core.weights.safetensors_io import read_checkpoint

            tensors = read_checkpoint(str(path))
        return push_via_store(self.conn, tensors, version, store=store, delta=delta,
                              full_every=full_every or DEFAULT_FULL_EVERY, timeout=timeout, force=force, mode=mode,
                              pool=self._pool(pool))

    def push_adapter(
        self, name: str, source: str | Path | Any, *, base: str | Path | None = None, store: str | None = None,
        adapter_name: str = "default", pool: str | None = None, keep: int = adapter_registry.DEFAULT_KEEP_VERSIONS,
        timeout: float | None = control_channel.DEFAULT_PUSH_TIMEOUT_S, mode: SwapMode = "drain",
    ) -> AdapterPushResult:
        """Store a LoRA adapter as the next version of `name` and make it the pool's current one
        (docs/adapters.md). `source`: a PEFT adapter directory (what peft's `save_pretrained` writes), or
        a peft model in memory (its adapter `adapter_name`). It is checked against the base model
        (`base`, a model directory; default: the pool's weight store, else a live worker's model
        directory) and refused naming the module that does not fit (`AdapterError`). Returns once
        every live worker serving adapters has read and checked the version (up to `timeout` s;
        `AdapterPushError` names those that failed or did not answer, and a version no worker took is
        undone): every job admitted after that runs it and its rows record it (`adapter_version`);
        jobs in flight finish on theirs, or with `mode="partial"` their samples on an older version
        of `name` stop and continue on this one (rows record each token's version:
        `adapter_version_segments`). The store keeps the adapter's last `keep` versions (0: all), and
        any a live worker holds."""
        from pipeline.weights import adapter_check
        from pipeline.weights.adapter_push import base_shapes, push_adapter_tensors

        adapter = (adapter_check.read_dir(source) if isinstance(source, str | Path)
                   else adapter_check.from_model(source, adapter_name))
        pool = self._pool(pool)
        shapes = base_shapes(self.conn, pool, None if base is None else str(base), store)
        return push_adapter_tensors(self.conn, name, adapter, base=shapes, pool=pool, store=store, keep=keep,
                                    timeout=timeout, mode=mode)

    def adapters(self, *, pool: str | None = None) -> dict[str, AdapterRecord]:
        """The pool's adapters by name: each one's current version, rank, target modules and store."""
        return adapter_registry.records(self.conn, self._pool(pool))

    def cancel(
        self, run: str | None = None, *, job_ids: Sequence[str] | None = None, pool: str | None = None,
    ) -> CancelResult:
        """Cancel every job of `run` (and/or the jobs `job_ids`), in every pool they were submitted
        to or only in `pool`: queued jobs are removed with their prompt ids, jobs in flight are
        aborted at their engine's next step and commit nothing; committed shards stay
        (docs/reading.md "Cancel")."""
        return cancel(self.conn, run=run, job_ids=list(job_ids) if job_ids else None, pool=pool)

    def follow(
        self,
        run: str,
        *,
        cursor: str | None = None,
        batch_id: str | None = None,
        block_ms: int = DEFAULT_BLOCK_MS,
        timeout: float | None = None,
        raise_on_failure: bool = True,
        rewards: bool = False,
    ) -> Follower:
        """Shards of `run` as workers commit them, after `cursor` (from the start without one).

        It ends when the batch (`batch_id`) or every batch submitted to the run is complete;
        jobs that failed end it too, raising `JobsFailedError` after the last shard unless
        `raise_on_failure=False` (then see `Follower.failed`). `timeout` (seconds) bounds the
        whole follow with `WaitTimeoutError`. `rewards=True` yields each shard once its rewards are
        recorded; read them with `shard.read(rewards=True)`.
        """
        return Follower(
            self.conn, run, cursor=cursor, batch_id=batch_id, block_ms=block_ms, timeout=timeout,
            raise_on_failure=raise_on_failure, rewards=rewards,
        )


def connect(url: str | None = None, *, pool: str | None = None) -> Client:
    """Connect to `url`, else `$PIPELINE_REDIS_URL`, else the embedded server (started if needed),
    working in `pool`, else `$PIPELINE_POOL`, else `default`."""
    return Client(connect_redis(url), pool)
