"""`pipeline verify`: recompute every stored completion logprob, teacher-forced, with the hf engine.

For a sample of a run's rows (all of them by default), the reference model (`HFEngine`'s
loading and model code, float32) runs one forward over prompt + completion (the last sampled
token is never fed) and the logprob of each completion token is taken under the row's stored
sampling contract, as the engines compute it (SGLang's semantics): log-softmax of the logits,
penalised by the row's frequency / presence / repetition penalties counted over the tokens it
generated before (`SamplingRows.penalise`, the hf engine's own code), divided by the temperature
(plain for greedy rows). min_new_tokens masks the model's own end tokens at the early positions;
a user's token-id stops are not stored in a shard, so such a mask is not reproduced.

Models per weight version: `model` is one path (every token is checked against it, whatever
version generated it: how shards of v1 are checked against v0) or a mapping version → path;
then a token is checked against its own version's model (per-token versions of rows continued
across partial swaps), and tokens of versions without a model are counted as unchecked.

LoRA adapters: a row generated with an adapter (`adapter`, `adapter_version`) is recomputed under
the base model plus that version of the adapter, read from its store (`store`: the pool's weight
store URL, under which adapters are kept; default the default pool's), in the same forward as
the base rows (the hf engine's mixed-batch forward). A row continued across a partial adapter push
(`adapter_version_segments`) is recomputed once per adapter version, each token checked under its own.

Routed experts (MoE rows that carry them): the forward's router hooks (`RoutingCapture`) give
the recomputed top-k per (position, layer), compared as sets with the stored ones; a row's
routing is its last version's (a continuation's prefill routes every earlier position again), so
it is checked with the model of that version.

It streams: rows are read a record batch at a time and forwarded in groups bounded by a memory
budget for the logits (`memory_mb`), so memory follows a batch, not the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa
import redis

from pipeline.core.adapters import adapter_url, stored_record
from pipeline.core.errors import PipelineError
from pipeline.core.routed_experts import ROUTED_EXPERTS_COLUMNS, routed_experts
from pipeline.core.shards import is_location, rollouts_dataset
from pipeline.core.verify_stats import ExpertStats, GroupStats, VerifyReport, build_report
from schemas.adapters import pinned, split_pinned
from schemas.request import RolloutRequest, SamplingParams

REQUIRED_COLUMNS = ["rollout_id", "engine", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
                    "weight_version", "temperature"]
PENALTY_COLUMNS = ["frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens"]
OPTIONAL_COLUMNS = ["weight_version_segments", "resumed_at", "adapter", "adapter_version", "adapter_version_segments",
                    *PENALTY_COLUMNS,
                    *ROUTED_EXPERTS_COLUMNS]
DEFAULT_THRESHOLD = 0.1
DEFAULT_MEMORY_MB = 512
READ_BATCH_ROWS = 256


def parse_models(specs: str | Sequence[str] | Mapping[int, str]) -> dict[int | None, str]:
    """`PATH` (every version) or `V=PATH` items (per version); a mapping passes through."""
    if isinstance(specs, Mapping):
        return {int(v): str(p) for v, p in specs.items()}
    items = [specs] if isinstance(specs, str) else list(specs)
    if not items:
        raise PipelineError("verify needs --model PATH (or --model V=PATH per weight version)")
    models: dict[int | None, str] = {}
    for item in items:
        version, sep, path = item.partition("=")
        if sep and version.strip().lstrip("-").isdigit():
            key: int | None = int(version)
        else:
            key, path = None, item
        if key in models:
            raise PipelineError(f"--model {item!r}: a model for {'every version' if key is None else f'v{key}'} "
                                "is given twice")
        models[key] = path
    if None in models and len(models) > 1:
        raise PipelineError("--model PATH (every version) and --model V=PATH cannot be mixed")
    return models


def open_source(source: str, conn: redis.Redis | None) -> Any:
    """The shards of a URL / directory, or of a run name through its commit log."""
    if is_location(source):
        dataset = rollouts_dataset(source)
    else:
        if conn is None:
            raise PipelineError(f"{source!r} is neither a URL nor an existing path; reading a run by name "
                                "needs a Redis connection (conn=... / --redis URL)")
        dataset = rollouts_dataset([], source, conn=conn)
    files = dataset.files  # rollouts_dataset raises NoShardsError, naming what is there, when there are none
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.schema.names]
    if missing:
        raise PipelineError(f"shards under {source!r} lack columns {missing} (first shard {files[0]}); "
                            "they are not rollout shards of this pipeline")
    return dataset


@dataclass
class _Row:
    rollout_id: str
    engine: str
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray  # per completion token
    params: SamplingParams
    experts: np.ndarray | None
    experts_start: int
    adapter: str | None  # pinned (`schemas.adapters.pinned`), None for the base
    covers: np.ndarray | None = None  # the completion tokens this check is for (bool); None: all
    counted: bool = True  # counted as a row (one row checked under two adapter versions counts once)


def _versions(row: dict[str, Any], length: int, column: str = "weight_version_segments",
              scalar: str = "weight_version") -> np.ndarray:
    segments = row.get(column)
    out = np.full(length, int(row[scalar]), dtype=np.int64)
    if segments:
        starts = [int(s["start"]) for s in segments]
        if starts[0] != 0 or starts != sorted(starts) or starts[-1] > max(length - 1, 0):
            raise PipelineError(f"row {row['rollout_id']!r}: {column} {segments} do not fit its "
                                f"{length} completion tokens; the shard is inconsistent")
        for s, end in zip(segments, [*starts[1:], length], strict=True):
            out[int(s["start"]):end] = int(s["version"])
    return out


def _per_adapter_version(row: dict[str, Any], base: _Row) -> Iterator[_Row]:
    """`base` once per adapter version its tokens came from (`adapter_version_segments`), each
    covering that version's tokens; `base` itself when they came from one."""
    if base.adapter is None or not row.get("adapter_version_segments"):
        yield base
        return
    versions = _versions(row, len(base.completion), "adapter_version_segments", "adapter_version")
    for index, version in enumerate(np.unique(versions)):
        yield replace(base, adapter=pinned(row["adapter"], int(version)), covers=versions == version,
                      counted=index == 0)


def _params(row: dict[str, Any]) -> SamplingParams:
    def value(name: str, default: float) -> float:
        v = row.get(name)
        return default if v is None else v

    return SamplingParams(
        temperature=float(row["temperature"]), frequency_penalty=float(value("frequency_penalty", 0.0)),
        presence_penalty=float(value("presence_penalty", 0.0)),
        repetition_penalty=float(value("repetition_penalty", 1.0)), min_new_tokens=int(value("min_new_tokens", 0)),
    )


LIST_COLUMNS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")


def _lists(column: pa.Array, dtype: type) -> list[np.ndarray | None]:
    """One numpy array per row of a list column (None for a null row), from its offsets and values."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]


def _rows_of(batch: pa.RecordBatch, vocab: int, skipped: dict[str, int]) -> Iterator[_Row]:
    """Validated rows of a record batch; rows without logprobs or completion are counted as skipped."""
    experts = routed_experts(batch) if all(c in batch.schema.names for c in ROUTED_EXPERTS_COLUMNS) else None
    prompts, completions = (_lists(batch.column(n), np.int64) for n in LIST_COLUMNS[:2])
    stored = _lists(batch.column("completion_logprobs"), np.float32)
    scalars = [n for n in batch.schema.names if n not in LIST_COLUMNS and n != "routed_experts"]
    for i, row in enumerate(batch.select(scalars).to_pylist()):
        rid = row["rollout_id"]
        prompt, completion, logprobs = prompts[i], completions[i], stored[i]
        nulls = [name for name, value in (("prompt_token_ids", prompt), ("completion_token_ids", completion),
                                          *((n, row[n]) for n in ("weight_version", "temperature", "engine")))
                 if value is None]
        if nulls or prompt is None or completion is None:
            raise PipelineError(f"row {rid!r}: column {nulls[0]} is null; the shard is inconsistent")
        if logprobs is None:
            skipped["stored without logprobs"] = skipped.get("stored without logprobs", 0) + 1
            continue
        if len(logprobs) != len(completion):
            raise PipelineError(f"row {rid!r}: {len(logprobs)} completion logprobs for {len(completion)} completion "
                                "tokens; the shard breaks the logprob contract")
        for name, ids in (("prompt_token_ids", prompt), ("completion_token_ids", completion)):
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise PipelineError(f"row {rid!r}: {name} holds id {int(bad[0])}, outside the model's vocabulary "
                                    f"(0..{vocab - 1}); wrong model or a corrupt shard")
        if not len(prompt):
            raise PipelineError(f"row {rid!r}: empty prompt_token_ids; the shard is inconsistent")
        if not len(completion):
            skipped["empty completion"] = skipped.get("empty completion", 0) + 1
            continue
        resumed = row.get("resumed_at")
        if resumed is not None and (any(b <= a for a, b in pairwise(resumed))
                                    or not all(0 < t < len(completion) for t in resumed)):
            raise PipelineError(f"row {rid!r}: resumed_at {resumed} are not ascending offsets inside its "
                                f"{len(completion)} completion tokens; the shard is inconsistent")
        adapter = row.get("adapter")
        if adapter is not None and row.get("adapter_version") is None:
            raise PipelineError(f"row {rid!r}: adapter {adapter!r} without an adapter_version; the shard is "
                                "inconsistent")
        yield from _per_adapter_version(row, _Row(
            rid, row["engine"], prompt, completion, logprobs, _versions(row, len(completion)), _params(row),
            experts[i] if experts is not None else None, int(row.get("routed_experts_start") or 0),
            None if adapter is None else pinned(adapter, int(row["adapter_version"]))))


class _Checker:
    """One reference model: teacher-forced logprobs (and router top-k) for groups of rows."""

    def __init__(self, path: str, device: str, store: str | None) -> None:
        import torch

        from workers.engines.hf.engine import HFEngine

        self.path = path
        self.store = store
        self.engine = HFEngine(path, device=device)
        self.torch = torch
        self.vocab = self.engine.vocab_size

    def close(self) -> None:
        self.engine.close()

    def run(self, rows: Sequence[_Row], want_experts: bool) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """Per row: the recomputed logprob of each completion token; its routed experts
        `[prompt + completion - 1, layers, top_k]` when asked and the model routes."""
        from workers.engines.hf.engine import SamplingRows

        torch = self.torch
        engine = self.engine
        device = engine.device
        fed = [np.concatenate([r.prompt, r.completion[:-1]]) for r in rows]
        width = max(len(f) for f in fed)
        keep = max(len(r.completion) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        for i, f in enumerate(fed):
            ids[i, width - len(f):] = torch.from_numpy(f).to(device)
            mask[i, width - len(f):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        adapters = [r.adapter for r in rows]
        self._load_adapters(adapters)
        routing = engine.routing if want_experts else None
        if routing is not None:
            routing.start(len(rows))
        try:
            with torch.inference_mode():
                logits = engine.forward(adapters, input_ids=ids, attention_mask=mask, position_ids=positions,
                                        use_cache=False, logits_to_keep=keep).logits
            experts: list[np.ndarray | None] = [None] * len(rows)
            if routing is not None:
                routing.step()
                experts = list(routing.finish([len(f) for f in fed], skip=[width - len(f) for f in fed]))
        finally:
            if routing is not None:
                routing.stop()
        out: list[np.ndarray] = []
        with torch.inference_mode():
            for i, row in enumerate(rows):
                n = len(row.completion)
                scores = logits[i, keep - n:].float()  # [n, vocab]: position t predicts completion token t
                target = torch.from_numpy(row.completion).to(device)
                p = row.params
                if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 or p.min_new_tokens:
                    request = RolloutRequest(id=row.rollout_id, input_ids=[int(t) for t in row.prompt[:1]],
                                             sampling_params=p)
                    sampling = SamplingRows([request], engine.hidden_stop_ids, self.vocab, torch, device)
                    counts = torch.zeros((1, self.vocab), dtype=torch.float32, device=device)
                    steps = []
                    for t in range(n):
                        steps.append(sampling.penalise(scores[t:t + 1], counts, t))
                        counts[0, target[t]] += 1
                    scores = torch.cat(steps)
                scaled = scores if p.greedy else scores / p.temperature
                lp = scaled.gather(1, target[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
                out.append(lp.cpu().numpy())
        return out, experts

    def _load_adapters(self, adapters: Sequence[str | None]) -> None:
        """The adapter versions of a group resident in the reference engine, read from their store."""
        cache = self.engine.adapters
        wanted = {a for a in adapters if a is not None}
        for key in wanted:
            name, version = split_pinned(key)
            assert version is not None
            cache.note(stored_record(adapter_url(self.store, None, name), name, version))
        cache.ensure(wanted)


def _groups_by_memory(rows: list[_Row], vocab: int, memory_mb: int, max_rows: int) -> Iterator[list[_Row]]:
    """Rows sorted by length, in groups whose logits (rows x longest completion x vocab floats) fit."""
    budget = memory_mb * 2**20
    group: list[_Row] = []
    longest = 0
    for row in sorted(rows, key=lambda r: len(r.prompt) + len(r.completion)):
        n = max(longest, len(row.completion))
        if group and ((len(group) + 1) * n * vocab * 4 > budget or len(group) >= max_rows):
            yield group
            group, n = [], len(row.completion)
        group.append(row)
        longest = n
    if group:
        yield group


def verify(
    source: str,
    model: str | Sequence[str] | Mapping[int, str],
    *,
    rows: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    threshold: float = DEFAULT_THRESHOLD,
    worst: int = 10,
    conn: redis.Redis | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_batch_rows: int = 64,
    store: str | None = None,
) -> VerifyReport:
    """Recompute the stored completion logprobs of `source` (a run name with `conn`, a URL or a
    directory of shards) with `model` and report the mismatch per weight version and engine.

    `rows`: check a random sample of that many rows (drawn with `seed`), else every row. `store`: the
    weight store URL the rows' LoRA adapters were pushed under (default: the default pool's).
    """
    models = parse_models(model)
    dataset = open_source(source, conn)
    names = [c for c in REQUIRED_COLUMNS + OPTIONAL_COLUMNS if c in dataset.schema.names]
    total = dataset.count_rows()
    chosen: np.ndarray | None = None
    if rows is not None and rows < total:
        if rows <= 0:
            raise PipelineError(f"--rows must be positive, not {rows}")
        chosen = np.sort(np.random.default_rng(seed).choice(total, size=rows, replace=False))
    checkers: dict[str, _Checker] = {}
    try:
        for path in dict.fromkeys(models.values()):
            checkers[path] = _Checker(path, device, store)
        vocab = min(c.vocab for c in checkers.values())
        groups: dict[tuple[int, str], GroupStats] = {}
        experts: dict[tuple[int, str], ExpertStats] = {}
        skipped: dict[str, int] = {}
        resumed = 0  # rows resumed from a checkpoint (`workers.jobs.checkpoint`): checked like any other
        offset = 0
        for batch in dataset.to_batches(columns=names, batch_size=READ_BATCH_ROWS):
            if chosen is not None:
                lo, hi = np.searchsorted(chosen, [offset, offset + batch.num_rows])
                picked = chosen[lo:hi] - offset
                offset += batch.num_rows
                if not picked.size:
                    continue
                batch = batch.take(pa.array(picked))
            else:
                offset += batch.num_rows
            if "resumed_at" in batch.schema.names:
                resumed += batch.num_rows - batch.column("resumed_at").null_count
            rows_in = list(_rows_of(batch, vocab, skipped))
            _check_batch(rows_in, models, checkers, groups, experts, threshold, worst, memory_mb, max_batch_rows)
    finally:
        for checker in checkers.values():
            checker.close()
    return build_report(list(groups.values()), list(experts.values()), skipped, threshold, resumed_rows=resumed)


def _check_batch(
    rows: list[_Row], models: dict[int | None, str], checkers: dict[str, _Checker],
    groups: dict[tuple[int, str], GroupStats], experts: dict[tuple[int, str], ExpertStats],
    threshold: float, worst: int, memory_mb: int, max_batch_rows: int,
) -> None:
    def group(version: int, engine: str) -> GroupStats:
        key = (version, engine)
        if key not in groups:
            path = models.get(None, models.get(version))
            groups[key] = GroupStats(version, engine, path, threshold, worst)
        return groups[key]

    for row in rows:
        for version in np.unique(row.versions):
            stats = group(int(version), row.engine)
            stats.rows += row.counted
            if models.get(None, models.get(int(version))) is None:
                stats.unchecked_tokens += int(_mine(row, version).size)
    for path, checker in checkers.items():
        mine = [r for r in rows if None in models or any(models.get(int(v)) == path for v in np.unique(r.versions))]
        for part in _groups_by_memory(mine, checker.vocab, memory_mb, max_batch_rows):
            want = [r for r in part if r.experts is not None and _routing_version(r, models) == path]
            recomputed, routed = checker.run(part, want_experts=bool(want) and checker.engine.routing is not None)
            for row, values, experts_row in zip(part, recomputed, routed, strict=True):
                for version in np.unique(row.versions):
                    if None not in models and models.get(int(version)) != path:
                        continue
                    where = _mine(row, version)
                    if where.size:
                        group(int(version), row.engine).add(row.rollout_id, where, row.logprobs[where], values[where])
                # A row's routing is its last segment's (adapter version too): checked once, with that one.
                last = row.covers is None or bool(row.covers[-1])
                if experts_row is not None and last and row.experts is not None and \
                        _routing_version(row, models) == path:
                    _compare_experts(row, experts_row, experts)


def _mine(row: _Row, version: int) -> np.ndarray:
    """The completion positions of `row` from weight `version` that this check of it covers."""
    same = row.versions == version
    return np.flatnonzero(same if row.covers is None else same & row.covers)


def _routing_version(row: _Row, models: dict[int | None, str]) -> str | None:
    return models.get(None, models.get(int(row.versions[-1])))


def _compare_experts(row: _Row, recomputed: np.ndarray, experts: dict[tuple[int, str], ExpertStats]) -> None:
    stored = np.sort(np.asarray(row.experts, dtype=np.int64), axis=-1)
    mine = np.sort(recomputed.astype(np.int64), axis=-1)[row.experts_start:row.experts_start + len(stored)]
    if mine.shape != stored.shape:
        raise PipelineError(f"row {row.rollout_id!r}: routed experts of shape {list(stored.shape)} from position "
                            f"{row.experts_start}, the model routes {list(recomputed.shape)} positions x layers x "
                            "top_k; wrong model or an inconsistent shard")
    equal = (mine == stored).all(axis=-1)  # [positions, layers]
    key = (int(row.versions[-1]), row.engine)
    layers = stored.shape[1]
    if key not in experts:
        experts[key] = ExpertStats(key[0], key[1], np.zeros(layers, np.int64), np.zeros(layers, np.int64))
    experts[key].checked += equal.shape[0]
    experts[key].matching += equal.sum(axis=0)


def exceeded(report: VerifyReport, max_abs_diff: float) -> bool:
    """Whether any checked token's |Δ| is above `max_abs_diff` (a non-finite one always is)."""
    value = report.max_abs_diff
    return not math.isnan(value) and value > max_abs_diff

