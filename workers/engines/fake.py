"""A fake engine behind the `Engine` protocol, shipped for tests and benchmarks (as httpx ships
`MockTransport`): deterministic outputs, no model, optional delays, a record of every call.

Sample i of a request emits `max_new_tokens` copies of token id (i + 1), each with logprob -0.5
(when logprobs were asked for), finishing with `length`; or, with `replies`, the token ids
`replies(request, i)` returns (a scripted model: tool calls, fixed answers), cut at
`max_new_tokens`, finishing with `stop` when they end with one of `end_ids` (the model's EOS).
Every batch takes `delay_s`; with `pace`, a batch reveals its tokens one position at a time,
calling `pace(k)` before position k of its samples (a test holds a turn mid-way there, or slows it
down), and `running_progress()` reports them so far (for streamed turns); a batch holding a
request whose id is in `fail_ids` raises `RuntimeError` (an engine bug, as far as the worker can
tell); a weight load takes `load_s` and fails like a missing checkpoint when the path contains "bad".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.engines.base import INTERRUPTED, EngineDescription, EngineIdentity, Finish, SampleOutput


class FakeEngine(EngineIdentity):
    """Deterministic outputs without a model; `calls` and `updates` record what the worker asked."""

    def __init__(
        self, *, delay_s: float = 0.0, load_s: float = 0.0, weight_version: int = 0, max_top_logprobs: int = 0,
        name: str = "fake", fail_ids: Collection[str] = (),
        replies: Callable[[RolloutRequest, int], Sequence[int]] | None = None, end_ids: Collection[int] = (),
        pace: Callable[[int], None] | None = None,
    ) -> None:
        self.pace = pace
        self._revealed: tuple[list[list[SampleOutput]], int] | None = None  # a paced batch, tokens shown
        self.replies = replies
        self.end_ids = frozenset(end_ids)
        self.delay_s = delay_s
        self.load_s = load_s
        self.fail_ids = frozenset(fail_ids)
        self._weight_version = weight_version
        self._description = EngineDescription(
            name=name, model=f"{name}-model",
            capabilities=Capabilities(max_top_logprobs=max_top_logprobs, vocab_size=1000),
            has_tokenizer=False,
        )
        self._lock = threading.Lock()
        self.calls: list[list[str]] = []  # request ids of each generate call
        self.updates: list[tuple[str, int]] = []  # (path, version) of each successful weight load

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        with self._lock:
            self.calls.append([r.id for r in requests])
        if self.delay_s:
            time.sleep(self.delay_s)
        failing = sorted(r.id for r in requests if r.id in self.fail_ids)
        if failing:
            raise RuntimeError(f"fake engine: requests {failing} fail (fail_ids)")
        outputs = self._outputs(requests, self._weight_version)
        if self.pace is not None:
            for k in range(max((len(s.token_ids) for samples in outputs for s in samples), default=0)):
                self.pace(k)
                with self._lock:
                    self._revealed = (outputs, k + 1)
            with self._lock:
                self._revealed = None
        return outputs

    def running_progress(self) -> list[list[SampleOutput]] | None:
        """The paced batch's samples so far (`CheckpointableEngine.progress`'s shape); None: none runs."""
        with self._lock:
            if self._revealed is None:
                return None
            outputs, shown = self._revealed
        return [[s if len(s.token_ids) <= shown else SampleOutput(
            token_ids=s.token_ids[:shown], finish=Finish("abort", message=INTERRUPTED),
            logprobs=None if s.logprobs is None else s.logprobs[:shown], weight_version=s.weight_version)
            for s in samples] for samples in outputs]

    def _outputs(self, requests: Sequence[RolloutRequest], version: int) -> list[list[SampleOutput]]:
        if self.replies is not None:
            return [[self._scripted(request, i, version) for i in range(request.sampling_params.n)]
                    for request in requests]
        return [
            [
                SampleOutput(
                    token_ids=np.full(request.sampling_params.max_new_tokens, i + 1, dtype=np.int32),
                    finish=Finish("length"),
                    logprobs=(np.full(request.sampling_params.max_new_tokens, -0.5, dtype=np.float32)
                              if request.logprobs is not None else None),
                    weight_version=version,
                )
                for i in range(request.sampling_params.n)
            ]
            for request in requests
        ]

    def _scripted(self, request: RolloutRequest, index: int, version: int) -> SampleOutput:
        assert self.replies is not None
        ids = np.asarray(list(self.replies(request, index))[: request.sampling_params.max_new_tokens], dtype=np.int32)
        ended = ids.size > 0 and int(ids[-1]) in self.end_ids
        return SampleOutput(
            token_ids=ids, finish=Finish("stop", matched=int(ids[-1])) if ended else Finish("length"),
            logprobs=np.full(ids.size, -0.5, dtype=np.float32) if request.logprobs is not None else None,
            weight_version=version,
        )

    def update_weights(self, path: str, version: int) -> None:
        """Record the load; a path containing "bad" fails like a missing checkpoint."""
        if self.load_s:
            time.sleep(self.load_s)
        if "bad" in str(path):
            raise FileNotFoundError(f"no weights at {path}")
        with self._lock:
            self.updates.append((str(path), version))
        self._weight_version = version

    def close(self) -> None:
        pass
