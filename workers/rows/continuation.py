"""Samples across partial weight swaps: what to submit next, and one sample from its segments.

At a partial swap the engine stops every sample in flight (`InterruptibleEngine.interrupt`);
`Progress` keeps, per sample of a job, the segments generated so far (each by one weight
version) and gives the next submission: each unfinished sample as a `ContinuedRequest` (prompt +
generated ids, the remaining budget, the same stops). Once every sample has finished,
`Progress.outputs` merges each sample's segments into one `SampleOutput`, with the contracts
held over the whole completion:

- per-token provenance: `version_segments` (start, version) runs; `logprobs[t]` is the logprob
  under the version that generated token t (the behaviour policy);
- `max_new_tokens` / `min_new_tokens` count the whole completion (a continuation gets what
  remains); `n` and seeds keep their meaning (a continuation is sample i of request r,
  `seeds.continuation_seed`);
- a stop string that straddles a boundary (the first segment ends in "\\n", the next begins
  with "\\n", the stop is "\\n\\n") stops the sample at the token that completed it, as an
  uninterrupted engine would; what the continuation generated after it is dropped (ids,
  logprobs, versions, routed experts). The text is decoded over the whole completion;
- penalties (frequency, presence, repetition) count an engine's own output ids, which a
  continuation cannot hand it: a sample with penalties is restarted from scratch on the new
  weights instead of continued (its tokens so far are dropped; `Progress.restarted` counts it);
- routed experts: the last segment's. The continuation's prefill routes every earlier position
  again under the newest weights, so the stored routing is one version's for the whole sequence
  (what routing replay of that version uses), not a splice of several;
- prompt logprobs and cached tokens: the first segment's (continuations do not ask again);
- the staleness bound (`max_staleness` K, per job): a sample is never continued, nor committed,
  holding a token from a version more than K behind the one the worker serves; it is generated
  again from the start instead (`Progress.stale`, counted in `restarted`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.request import RolloutRequest, SamplingParams
from workers.engines.base import ContinuedRequest, Finish, SampleOutput
from workers.errors import ContractViolation

Decode = Callable[[Sequence[int], bool], "str | None"]
Slot = tuple[int, int]  # (request index in the job, sample index)


@dataclass
class Submission:
    """Requests handed to the engine at once, and which job sample each output belongs to."""

    requests: list[RolloutRequest]
    slots: list[list[Slot]]  # parallel to `requests`: one slot per output sample
    version: int  # the engine's weights when submitted (for outputs that report none)


@dataclass
class _Part:
    output: SampleOutput
    version: int


def has_penalties(params: SamplingParams) -> bool:
    """Penalties that see the engine's own output ids only, which a continuation cannot carry."""
    return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0)


@dataclass
class Progress:
    """Every sample of one job's requests, across however many partial swaps."""

    requests: list[RolloutRequest]
    max_staleness: int | None = None
    _parts: list[list[list[_Part]]] = field(init=False)
    _finished: list[list[bool]] = field(init=False)
    _interrupted: list[list[bool]] = field(init=False)
    unfinished: int = field(init=False)
    restarted: int = 0  # samples whose tokens were dropped and generated again from the start
    continued: int = 0  # continuations submitted

    def __post_init__(self) -> None:
        self._parts = [[[] for _ in range(r.sampling_params.n)] for r in self.requests]
        self._finished = [[False] * r.sampling_params.n for r in self.requests]
        self._interrupted = [[False] * r.sampling_params.n for r in self.requests]
        self.unfinished = sum(r.sampling_params.n for r in self.requests)

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    def first(self, version: int) -> Submission:
        return Submission(list(self.requests),
                          [[(r, i) for i in range(req.sampling_params.n)] for r, req in enumerate(self.requests)],
                          version)

    def record(self, submission: Submission, outputs: Sequence[Sequence[SampleOutput]]) -> None:
        """Take a submission's outputs: finished samples are kept, interrupted ones wait to continue
        (penalised ones from the start: their tokens are dropped)."""
        if len(outputs) != len(submission.requests):
            raise ContractViolation(f"engine returned {len(outputs)} outputs for {len(submission.requests)} requests")
        for request, samples, slots in zip(submission.requests, outputs, submission.slots, strict=True):
            if len(samples) != len(slots):
                raise ContractViolation(f"request {request.id!r}: {len(samples)} samples for n={len(slots)}")
            for sample, (r, i) in zip(samples, slots, strict=True):
                if self._finished[r][i]:
                    raise ContractViolation(f"request {request.id!r}: sample {i} came back twice")
                parts = self._parts[r][i]
                version = submission.version if sample.weight_version is None else sample.weight_version
                original = self.requests[r]
                if not sample.finish.interrupted:
                    parts.append(_Part(sample, version))
                    self._finish(r, i)
                    continue
                self._interrupted[r][i] = True
                if not len(sample.token_ids):  # stopped before its first token: nothing to keep
                    continue
                parts.append(_Part(sample, version))
                kept = sum(len(p.output.token_ids) for p in parts)
                if kept >= original.sampling_params.max_new_tokens:  # stopped on its last token: done
                    parts[-1].output = _with_finish(sample, Finish("length"))
                    self._finish(r, i)
                    continue
                if has_penalties(original.sampling_params):
                    parts.clear()
                    self.restarted += 1

    def _finish(self, r: int, i: int) -> None:
        self._finished[r][i] = True
        self.unfinished -= 1

    def _too_old(self, r: int, i: int, version: int) -> bool:
        parts = [p for p in self._parts[r][i] if len(p.output.token_ids)]
        return (self.max_staleness is not None and bool(parts)
                and version - min(p.version for p in parts) > self.max_staleness)

    def stale(self, version: int) -> int:
        """Restart every finished sample holding a token more than `max_staleness` versions behind
        `version` (the weights the worker serves now); the number restarted. Check before commit."""
        count = 0
        for r, request in enumerate(self.requests):
            for i in range(request.sampling_params.n):
                if self._finished[r][i] and self._too_old(r, i, version):
                    self._parts[r][i].clear()
                    self._finished[r][i] = False
                    self._interrupted[r][i] = True
                    self.unfinished += 1
                    count += 1
        self.restarted += count
        return count

    def resume(self, version: int) -> Submission:
        """Every unfinished sample as a continuation on `version` (from the start when it has
        nothing to keep, has penalties, or would break the staleness bound)."""
        requests: list[RolloutRequest] = []
        slots: list[list[Slot]] = []
        for r, request in enumerate(self.requests):
            for i in range(request.sampling_params.n):
                if self._finished[r][i]:
                    continue
                parts = self._parts[r][i]
                if self._too_old(r, i, version):
                    parts.clear()
                    self.restarted += 1
                generated = (np.concatenate([p.output.token_ids for p in parts]).astype(np.int32)
                             if parts else np.empty(0, np.int32))
                requests.append(continuation(request, i, generated, first=not parts))
                slots.append([(r, i)])
        self.continued += len(requests)
        return Submission(requests, slots, version)

    def outputs(self, decode: Decode | None) -> list[list[SampleOutput]]:
        """One merged output per sample; a sample never interrupted is the engine's output as is."""
        return [
            [self._merged(r, i, decode) for i in range(request.sampling_params.n)]
            for r, request in enumerate(self.requests)
        ]

    def _merged(self, r: int, i: int, decode: Decode | None) -> SampleOutput:
        request, parts = self.requests[r], self._parts[r][i]
        if not self._finished[r][i] or not parts:
            raise ContractViolation(f"request {request.id!r}: sample {i} has not finished")
        if not self._interrupted[r][i]:
            return parts[0].output
        return merge(request, [(p.output, p.version) for p in parts], decode)


def continuation(request: RolloutRequest, index: int, generated: np.ndarray, *, first: bool) -> ContinuedRequest:
    """Sample `index` of `request` resumed after `generated`: prompt + those ids, what remains of
    the budget, the same stops; prompt logprobs only when nothing was kept (`first`)."""
    params = request.sampling_params
    k = len(generated)
    remaining = params.model_copy(update={
        "n": 1, "max_new_tokens": params.max_new_tokens - k, "min_new_tokens": max(0, params.min_new_tokens - k),
    })
    values = dict(request)
    values.update(input_ids=[*request.input_ids, *generated.tolist()], sampling_params=remaining,
                  prompt_logprobs=request.prompt_logprobs if first else None)
    return ContinuedRequest.model_construct(**values, sample_index=index, generated=k)


def _with_finish(sample: SampleOutput, finish: Finish) -> SampleOutput:
    return SampleOutput(**{**sample.__dict__, "finish": finish})


def merge(request: RolloutRequest, parts: Sequence[tuple[SampleOutput, int]], decode: Decode | None) -> SampleOutput:
    """One sample from its segments (each `(output, version)`), contracts over the whole completion."""
    who = f"request {request.id!r}"
    params = request.sampling_params
    outputs = [p for p, _ in parts]
    tokens = np.concatenate([np.asarray(o.token_ids, dtype=np.int32) for o in outputs])
    logprobs = None
    if request.logprobs is not None:
        for o in outputs:
            if o.logprobs is None or len(o.logprobs) != len(o.token_ids):
                raise ContractViolation(f"{who}: a segment has logprobs missing or not one per token")
        logprobs = np.concatenate([np.asarray(o.logprobs, dtype=np.float32) for o in outputs])
    tops = None
    if request.logprobs:
        if any(o.top_logprobs is None for o in outputs):
            raise ContractViolation(f"{who}: a segment has no top logprobs")
        tops = [position for o in outputs for position in (o.top_logprobs or [])]
    segments: list[tuple[int, int]] = []
    boundaries: list[int] = []
    start = 0
    for output, version in parts:
        if len(output.token_ids):
            if start:
                boundaries.append(start)
            if not segments or segments[-1][1] != version:
                segments.append((start, version))
            start += len(output.token_ids)
    if not segments:
        segments = [(0, parts[-1][1])]
    last = outputs[-1]
    finish = last.finish
    routed = last.routed_experts
    cut = straddling_stop(tokens, boundaries, params, decode) if decode is not None else None
    if cut is not None:
        t, matched = cut
        tokens = tokens[:t]
        logprobs = None if logprobs is None else logprobs[:t]
        tops = None if tops is None else tops[:t]
        segments = [s for s in segments if s[0] < t]
        finish = Finish("stop", matched=matched)
        if routed is not None:
            routed = routed[: max(0, len(request.input_ids) + t - 1 - last.routed_experts_start)]
    text = None
    if decode is not None:
        token_stopped = isinstance(finish.matched, int) and not params.no_stop_trim
        text = decode((tokens[:-1] if token_stopped else tokens).tolist(), params.skip_special_tokens)
    return SampleOutput(
        token_ids=tokens, finish=finish, logprobs=logprobs, top_logprobs=tops,
        prompt_logprobs=outputs[0].prompt_logprobs, text=text, cached_tokens=outputs[0].cached_tokens,
        routed_experts=routed, routed_experts_start=last.routed_experts_start,
        weight_version=None, version_segments=segments,
    )


def straddling_stop(
    tokens: np.ndarray, boundaries: Sequence[int], params: SamplingParams, decode: Decode
) -> tuple[int, str] | None:
    """The first token count t (at least `min_new_tokens`) whose token completes a stop string the
    engine, seeing only one segment, could not: one that began before a boundary and ends after it.

    Only the stretch within reach of a boundary is decoded (a stop no longer than `longest`
    characters that straddles the boundary ends within `longest` characters after it; the window
    reaches back 4 tokens a character, for byte-level tokens). Returns (tokens, stop) or None.
    """
    stops = params.stop_strings
    if not stops or not boundaries:
        return None
    longest = max(len(s) for s in stops)
    reach = 4 * longest + 8
    for b in boundaries:
        window = max(0, b - reach)
        before = decode(tokens[window:b].tolist(), params.skip_special_tokens) or ""
        previous = before
        for t in range(b + 1, min(len(tokens), b + reach) + 1):
            text = decode(tokens[window:t].tolist(), params.skip_special_tokens) or ""
            if t >= params.min_new_tokens:
                # Stops that token t completed: they end in the text it added.
                found = [(text.find(s, max(0, len(previous) - len(s) + 1)), s) for s in stops]
                hits = [(at, s) for at, s in found if at >= 0]
                if hits:
                    return t, min(hits)[1]
            if len(text) - len(before) >= longest:
                break
            previous = text
    return None
