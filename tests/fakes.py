"""A fake engine behind the `Engine` protocol: deterministic outputs, optional delay, no model."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.engines.base import EngineDescription, EngineIdentity, Finish, SampleOutput


class FakeEngine(EngineIdentity):
    """Sample i of a request emits max_new_tokens copies of (i + 1); logprob -0.5 each."""

    def __init__(self, *, delay_s: float = 0.0, weight_version: int = 0, max_top_logprobs: int = 0) -> None:
        self.delay_s = delay_s
        self._weight_version = weight_version
        self._description = EngineDescription(
            name="fake", model="fake-model",
            capabilities=Capabilities(max_top_logprobs=max_top_logprobs, vocab_size=1000),
            has_tokenizer=False,
        )
        self.calls: list[list[str]] = []
        self.updates: list[tuple[str, int]] = []
        self.update_delay_s = 0.0

    def generate(self, requests: Sequence[RolloutRequest]) -> list[list[SampleOutput]]:
        self.calls.append([r.id for r in requests])
        if self.delay_s:
            time.sleep(self.delay_s)
        outputs = []
        for request in requests:
            count = request.sampling_params.max_new_tokens
            outputs.append([
                SampleOutput(
                    token_ids=np.full(count, i + 1, dtype=np.int32),
                    finish=Finish("length"),
                    logprobs=np.full(count, -0.5, dtype=np.float32) if request.logprobs is not None else None,
                    weight_version=self._weight_version,
                )
                for i in range(request.sampling_params.n)
            ])
        return outputs

    def update_weights(self, path: str, version: int) -> None:
        """Record the update; a path containing "bad" fails like a missing checkpoint."""
        if self.update_delay_s:
            time.sleep(self.update_delay_s)
        if "bad" in str(path):
            raise FileNotFoundError(f"no weights at {path}")
        self.updates.append((str(path), version))
        self._weight_version = version

    def close(self) -> None:
        pass
