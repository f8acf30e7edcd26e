"""An independent reference of SGLang 0.5's sampling rules, for testing engines against.

Written from SGLang's own code, not from the engines': `srt/sampling/sampling_params.py`
(temperature below 1e-6 means greedy: top_k 1, temperature 1), `srt/sampling/penaltylib/`
(frequency, presence and repetition penalizers fed with *output* tokens only; the min-new-tokens
penalizer puts -inf on stop tokens), `srt/sampling/sampling_batch_info.py` (overlap mode: the
additive penalties are summed and added, then the scaling ones applied) and `srt/layers/sampler.py`
(logprobs: log-softmax of the penalised logits over the temperature, before filtering;
`top_k_top_p_min_p_sampling_from_probs_torch`: sort, rank >= top_k dropped, a token dropped when
the mass before it exceeds top_p, then min_p against the largest probability).

One sequence at a time, in float64 numpy, from logits a test computes with its own forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS


@dataclass(frozen=True)
class Rule:
    """The parameters that shape one step's distribution (SGLang's names)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def penalised(logits: np.ndarray, generated: Sequence[int], rule: Rule, stop_ids: Iterable[int] = ()) -> np.ndarray:
    """The logits after SGLang's penalizers, given the tokens this sample generated before."""
    scores = np.asarray(logits, dtype=np.float64).copy()
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=scores.shape[0]).astype(np.float64)
    additive = -rule.frequency_penalty * counts - rule.presence_penalty * (counts > 0)
    if len(generated) < rule.min_new_tokens:
        for token in stop_ids:
            additive[token] = -np.inf
    scores = scores + additive
    if rule.repetition_penalty != 1.0:
        factor = np.where(counts > 0, rule.repetition_penalty, 1.0)
        scores = np.where(scores < 0, scores * factor, scores / factor)
    return scores


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    shifted = x - finite.max()
    return shifted - np.log(np.exp(shifted).sum())


def logprobs(scores: np.ndarray, rule: Rule) -> np.ndarray:
    """What SGLang stores: log-softmax of the penalised logits over the temperature (1 when greedy)."""
    return log_softmax(scores if rule.greedy else scores / rule.temperature)


def allowed(scores: np.ndarray, rule: Rule, slack: float = 0.0) -> set[int]:
    """The tokens the sampler may draw. `slack` widens every cut-off by that much probability mass,
    so float rounding at a boundary does not decide a test (the strict set is `slack=0`)."""
    if rule.greedy:
        best = scores.max()
        return {int(t) for t in np.flatnonzero(scores >= best - slack)}
    probs = np.exp(logprobs(scores, rule))
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    before = np.cumsum(sorted_probs) - sorted_probs
    keep = sorted_probs > 0
    if 0 < rule.top_k < len(probs):
        kth = sorted_probs[rule.top_k - 1]
        keep &= sorted_probs >= kth - slack  # ties with the k-th may be ranked either way
    keep &= before <= rule.top_p + slack
    if rule.min_p > 0:
        keep &= sorted_probs >= sorted_probs[0] * rule.min_p - slack
    return {int(t) for t in order[keep]}
