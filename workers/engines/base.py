"""The engine seam: what every adapter (hf, sglang, sglang-http, vllm-http, sim) takes and returns.

An engine returns raw outputs in SGLang's terms (a finish with a `matched` int or string);
`workers.rows.contracts` turns them into rows, the same way for every engine.

Partial weight swaps (`InterruptibleEngine`): `interrupt()` stops every sample in flight at its
next step; each stopped sample comes back with what it generated so far and the finish
`Finish("abort", message=INTERRUPTED)`. The worker later submits it again as a
`ContinuedRequest` (prompt + generated ids, the remaining budget) on the new weights
(`workers.rows.continuation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeGuard

import numpy as np

from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities

FinishKind = Literal["stop", "length", "abort"]
# `Finish.message` of a sample stopped by `InterruptibleEngine.interrupt` (to be continued).
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Finish:
    """Why a sample ended, as SGLang reports it (`meta_info.finish_reason`)."""

    kind: FinishKind
    # For kind "stop": the token id (EOS, hidden stop id or user stop id) or the stop string.
    matched: int | str | None = None
    message: str | None = None

    @property
    def interrupted(self) -> bool:
        """Stopped by a partial weight swap, not finished: the worker continues it."""
        return self.kind == "abort" and self.message == INTERRUPTED


class ContinuedRequest(RolloutRequest):
    """Sample `sample_index` of a request, resumed after a partial swap.

    `input_ids` is the original prompt followed by the `generated` ids the sample produced so
    far (verbatim, never re-tokenized); `max_new_tokens` and `min_new_tokens` are what remains of
    the original budget; `n` is 1; stops, temperature and the other parameters are unchanged.
    Engines draw its tokens from `seeds.continuation_seed(seed, sample_index, generated)`, so a
    continued sample keeps its identity (sample i of request r) and its seed keeps a meaning.
    """

    sample_index: int
    generated: int

    @property
    def prompt_length(self) -> int:
        """Tokens of the original prompt (the rest of `input_ids` was generated)."""
        return len(self.input_ids) - self.generated


@dataclass
class SampleOutput:
    """One sample (one of `n`) as the engine produced it."""

    token_ids: np.ndarray  # int32, verbatim as sampled, stop/EOS token included
    finish: Finish
    logprobs: np.ndarray | None = None  # float32, one per token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position, best first
    prompt_logprobs: list[float | None] | None = None  # one per prompt token, first None
    text: str | None = None  # decoded completion (stop string may still be in it)
    cached_tokens: int = 0
    routed_experts: np.ndarray | None = None  # [rows, layers, top_k]
    routed_experts_start: int = 0
    weight_version: int | None = None
    # Per-token provenance of a sample continued across partial swaps: (start, version) runs over
    # `token_ids`, set by `workers.rows.continuation`; None: every token from `weight_version`.
    version_segments: list[tuple[int, int]] | None = None
    # The same for the LoRA adapter's versions, across partial adapter swaps; None: every token from
    # the version the request pinned.
    adapter_version_segments: list[tuple[int, int]] | None = None
    # Completion offsets where the sample was resumed from a checkpoint after its worker was lost
    # (`workers.jobs.checkpoint`); None: never resumed.
    resumed_at: list[int] | None = None


@dataclass
class EngineDescription:
    """Static facts about a loaded engine, for rows and the worker registry."""

    name: str
    model: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    # Experts per layer for MoE models (sizes the routed-experts column), else None.
    num_experts: int | None = None
    has_tokenizer: bool = True

    @property
    def served(self) -> Capabilities:
        """What a worker around this engine serves (registered, and checked against each job):
        `capabilities`, with stop strings only when the engine has a tokenizer."""
        if self.has_tokenizer or not self.capabilities.stop_strings:
            return self.capabilities
        return self.capabilities.model_copy(update={"stop_strings": False})


class EngineIdentity:
    """What every engine reports from its own state: `description` from `_description` and
    `weight_version` from `_weight_version` (set by the constructor, again by `update_weights`)."""

    _description: EngineDescription
    _weight_version: int

    @property
    def description(self) -> EngineDescription:
        return self._description

    @property
    def weight_version(self) -> int:
        return self._weight_version


class Engine(Protocol):
    """One loaded inference engine. Loads once, serves many batches."""

    @property
    def description(self) -> EngineDescription: ...

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        """All samples of every request (outer list parallel to `requests`, inner `n` long)."""
        ...

    def update_weights(self, path: str, version: int) -> None:
        """Load new weights from `path` and serve them as `version`, between batches.

        On failure raise and keep serving the previous weights and version.
        """
        ...

    def close(self) -> None: ...


class ConcurrentEngine(Engine, Protocol):
    """The optional concurrent interface: several batches in flight at once.

    A worker feeds such an engine the next job's requests while the last long sequences of the
    previous job finish (see `workers.jobs.feeder`); engines without it run one `generate` at a time.
    """

    @property
    def capacity(self) -> int:
        """Sequences (samples) the engine decodes at once."""
        ...

    def load(self) -> int:
        """Sequences submitted and not yet finished (running and waiting)."""
        ...

    def submit(self, requests: Sequence[RolloutRequest]) -> Future[list[list[SampleOutput]]]:
        """Start a batch; the future holds what `generate` would return. Cancelling it aborts the batch."""
        ...


class InterruptibleEngine(ConcurrentEngine, Protocol):
    """A concurrent engine that can stop its samples in flight for a partial weight swap."""

    def interrupt(self) -> int:
        """Stop every sample submitted before this call and not finished, at its next step.

        Each batch's future resolves with what its samples generated so far; the unfinished ones
        end with `Finish("abort", message=INTERRUPTED)` (zero tokens when still waiting for a
        slot). Returns once every such future has resolved, with the number of samples stopped.
        Samples submitted after the call run as usual.
        """
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str | None:
        """The text of `token_ids` (None without a tokenizer): a continued sample's text is decoded
        over its whole completion, not glued from the segments' texts."""
        ...


class CheckpointableEngine(InterruptibleEngine, Protocol):
    """An interruptible engine that can report the progress of its samples in flight, so a worker
    checkpoints them periodically (`workers.jobs.checkpoint`). Engines without it are checkpointed
    only at partial swaps (from `interrupt()`'s outputs), never mid-sample."""

    def progress(self, future: Future[list[list[SampleOutput]]]) -> list[list[SampleOutput]] | None:
        """What the batch behind `future` (from `submit`) has generated so far, shaped as its result:
        finished samples as they will be returned, unfinished ones with their tokens so far (zero when
        waiting for a slot) and `Finish("abort", message=INTERRUPTED)`. A snapshot: the batch runs on.
        None when the engine no longer holds the batch (it resolved)."""
        ...


class StoreApplyingEngine(Engine, Protocol):
    """An engine that takes a version of a weight store (`pipeline.core.weights.store`) in place: the
    changed tensors applied to the loaded ones and checked bit for bit, instead of a full reload from a
    directory (`workers.process.store_load`). Engines without it load a materialised copy in full."""

    def apply_store_version(self, store: Any, have: int | None, version: int) -> Any:
        """Take the loaded tensors from version `have` (None: none of the store's) to `version`; the
        result's `how`, `bytes_read` and `detail` go into the acknowledgement."""
        ...


class StoreStagingEngine(StoreApplyingEngine, Protocol):
    """A store-applying engine that computes and checks the next version beside the loaded one while
    it keeps generating, so the pause only installs it."""

    def stage_store_version(self, store: Any, have: int | None, version: int) -> Any:
        """`version` computed and checked, not yet served; `install_store_version` puts it in."""
        ...

    def install_store_version(self, staged: Any) -> Any:
        """Serve a staged version (the engine paused); returns what `apply_store_version` returns."""
        ...


def applies_store_versions(engine: object) -> TypeGuard[StoreApplyingEngine]:
    return callable(getattr(engine, "apply_store_version", None))


def stages_store_versions(engine: object) -> TypeGuard[StoreStagingEngine]:
    return applies_store_versions(engine) and all(
        callable(getattr(engine, name, None)) for name in ("stage_store_version", "install_store_version"))


def is_checkpointable(engine: object) -> bool:
    """Interruptible, with a `progress()` whose snapshots hold all a checkpoint needs (an engine whose
    snapshots hold token ids only, `snapshots_complete = False`, serves streamed turns with them)."""
    return (is_interruptible(engine) and callable(getattr(engine, "progress", None))
            and getattr(engine, "snapshots_complete", True))


def is_interruptible(engine: object) -> bool:
    return is_concurrent(engine) and all(callable(getattr(engine, name, None)) for name in ("interrupt", "decode"))


def is_concurrent(engine: object) -> bool:
    return all(callable(getattr(engine, name, None)) for name in ("submit", "load")) and hasattr(engine, "capacity")
