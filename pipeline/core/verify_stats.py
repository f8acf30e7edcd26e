"""What `pipeline verify` reports: streaming statistics of stored vs recomputed logprobs.

Per group (weight version, engine), from Δ = recomputed − stored logprob of every checked
completion token (the stored one is the behaviour policy's, the recomputed one the reference
model's), kept in memory bounded by the group count, not by the run:

- tokens, mean / p99 / max |Δ|, the share of tokens with |Δ| above a threshold;
- the KL estimators of Schulman ("Approximating KL divergence", 2020) for samples drawn from the
  behaviour policy q, with r = p/q = exp(Δ): k1 = −log r (unbiased, noisy), k3 = (r − 1) − log r
  (unbiased, never negative); their means estimate KL(q ‖ p);
- the importance ratio r = exp(Δ): mean / p99 / max (what a trainer's TIS/MIS correction sees);
- the tokens that disagree most (rollout id, position, both values).

Percentiles come from a fixed log-spaced histogram (100 bins per decade, 1e-9 .. 1e4): a
reported p99 is the upper edge of its bin, at most 2.4 % above the exact value. Routed experts:
per layer, how many (token, layer) expert sets equal the recomputed router's.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

_DECADES = (-9, 4)
_PER_DECADE = 100
_EDGES = np.logspace(_DECADES[0], _DECADES[1], (_DECADES[1] - _DECADES[0]) * _PER_DECADE + 1)
# Signed edges for Δ: -1e4 .. -1e-9, then 0, then 1e-9 .. 1e4 (values beyond fall in the end bins).
_SIGNED = np.concatenate([-_EDGES[::-1], [0.0], _EDGES])


class Quantiles:
    """A fixed-bin histogram of signed values: bounded memory, quantiles to a bin's upper edge."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(_SIGNED) + 1, dtype=np.int64)
        self.n = 0
        self.max = -math.inf

    def add(self, values: np.ndarray) -> None:
        if not values.size:
            return
        self.counts += np.bincount(np.searchsorted(_SIGNED, values, side="left"), minlength=len(self.counts))
        self.n += int(values.size)
        self.max = max(self.max, float(values.max()))

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding the q-quantile (the largest value for the last bin)."""
        if not self.n:
            return math.nan
        rank = max(1, math.ceil(q * self.n))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        return self.max if index >= len(_SIGNED) else min(float(_SIGNED[index]), self.max)


@dataclass
class GroupStats:
    """The running figures of one (weight version, engine) group."""

    weight_version: int
    engine: str
    model: str | None
    threshold: float
    worst_kept: int = 10
    rows: int = 0
    tokens: int = 0
    unchecked_tokens: int = 0  # tokens of this version with no model given for it
    nonfinite: int = 0  # a stored or recomputed logprob of -inf/nan
    above: int = 0
    sum_abs: float = 0.0
    sum_k1: float = 0.0
    sum_k3: float = 0.0
    sum_ratio: float = 0.0
    max_abs: float = 0.0
    abs_q: Quantiles = field(default_factory=Quantiles)
    delta_q: Quantiles = field(default_factory=Quantiles)
    _worst: list[tuple[float, int, str, int, float, float]] = field(default_factory=list)
    _serial: int = 0

    def add(self, rollout_id: str, positions: np.ndarray, stored: np.ndarray, recomputed: np.ndarray) -> None:
        """The checked tokens of one row (`positions` index its completion)."""
        stored = stored.astype(np.float64)
        recomputed = recomputed.astype(np.float64)
        delta = recomputed - stored
        finite = np.isfinite(delta)
        self.nonfinite += int((~finite).sum())
        if not finite.all():
            self.max_abs = math.inf
            self.above += int((~finite).sum())
        d = delta[finite]
        a = np.abs(d)
        self.tokens += int(delta.size)
        self.above += int((a > self.threshold).sum())
        self.sum_abs += float(a.sum())
        self.sum_k1 += float((-d).sum())
        ratio = np.exp(d)
        self.sum_ratio += float(ratio.sum())
        self.sum_k3 += float((ratio - 1.0 - d).sum())
        if a.size:
            self.max_abs = max(self.max_abs, float(a.max()))
        self.abs_q.add(a)
        self.delta_q.add(d)
        # The row's worst token (|Δ|, inf for non-finite) competes for the group's worst list.
        key = np.where(finite, np.abs(delta), math.inf)
        if key.size:
            i = int(np.argmax(key))
            self._serial += 1
            item = (float(key[i]), self._serial, rollout_id, int(positions[i]), float(stored[i]), float(recomputed[i]))
            if len(self._worst) < self.worst_kept:
                heapq.heappush(self._worst, item)
            else:
                heapq.heappushpop(self._worst, item)

    def finite_tokens(self) -> int:
        return self.tokens - self.nonfinite

    def summary(self) -> dict[str, Any]:
        n = self.finite_tokens()

        def mean(total: float) -> float:
            return total / n if n else math.nan

        return {
            "weight_version": self.weight_version, "engine": self.engine, "model": self.model,
            "rows": self.rows, "tokens": self.tokens, "unchecked_tokens": self.unchecked_tokens,
            "nonfinite_tokens": self.nonfinite,
            "mean_abs_diff": mean(self.sum_abs), "p99_abs_diff": self.abs_q.quantile(0.99),
            "max_abs_diff": self.max_abs if self.tokens else math.nan,
            "k1": mean(self.sum_k1), "k3": mean(self.sum_k3),
            "ratio_mean": mean(self.sum_ratio),
            "ratio_p99": math.exp(self.delta_q.quantile(0.99)) if n else math.nan,
            "ratio_max": math.exp(self.delta_q.max) if n else math.nan,
            "share_above": self.above / self.tokens if self.tokens else math.nan,
        }

    def worst(self) -> list[dict[str, Any]]:
        return [
            {"weight_version": self.weight_version, "engine": self.engine, "rollout_id": rid, "position": pos,
             "stored_logprob": s, "recomputed_logprob": r, "abs_diff": key}
            for key, _, rid, pos, s, r in sorted(self._worst, key=lambda t: (-t[0], t[1]))
        ]


@dataclass
class ExpertStats:
    """Per layer, (token, layer) expert sets checked and how many equal the recomputed router's."""

    weight_version: int
    engine: str
    checked: np.ndarray
    matching: np.ndarray

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"weight_version": self.weight_version, "engine": self.engine, "layer": layer,
             "positions": int(c), "matching": int(m), "share": float(m / c) if c else math.nan}
            for layer, (c, m) in enumerate(zip(self.checked, self.matching, strict=True))
        ]


SUMMARY_TYPES = {
    "weight_version": pa.int64(), "engine": pa.string(), "model": pa.string(), "rows": pa.int64(),
    "tokens": pa.int64(), "unchecked_tokens": pa.int64(), "nonfinite_tokens": pa.int64(),
    **{name: pa.float64() for name in ("mean_abs_diff", "p99_abs_diff", "max_abs_diff", "k1", "k3", "ratio_mean",
                                       "ratio_p99", "ratio_max", "share_above")},
}


@dataclass
class VerifyReport:
    """`pipeline verify`'s result: `table` (one row per weight version and engine), `worst`
    (the tokens that disagree most), `experts` (routed-expert agreement per layer), and the
    rows read but not checked (`skipped`: reason → rows); `resumed_rows`: rows resumed from a
    checkpoint after their worker died, checked like any other (each token under its version)."""

    table: pa.Table
    worst: pa.Table
    experts: pa.Table
    skipped: dict[str, int]
    threshold: float
    resumed_rows: int = 0

    @property
    def max_abs_diff(self) -> float:
        """The largest |Δ| over every checked token (nan when none was checked)."""
        values = [v for v in self.table.column("max_abs_diff").to_pylist() if not math.isnan(v)]
        return max(values) if values else math.nan

    @property
    def tokens(self) -> int:
        return sum(self.table.column("tokens").to_pylist())

    @property
    def share_above(self) -> float:
        """The share of every checked token with |Δ| above the threshold (nan when none was checked)."""
        rows = [(r["tokens"], r["share_above"]) for r in self.table.select(["tokens", "share_above"]).to_pylist()
                if r["tokens"]]
        total = sum(tokens for tokens, _ in rows)
        return sum(tokens * share for tokens, share in rows) / total if total else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.table.to_pylist(), "worst": self.worst.to_pylist(),
                "experts": self.experts.to_pylist(), "skipped": self.skipped, "threshold": self.threshold,
                "max_abs_diff": self.max_abs_diff, "tokens": self.tokens, "resumed_rows": self.resumed_rows}

    def to_json(self) -> str:
        def clean(value: Any) -> Any:  # JSON has no inf/nan: null
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        return json.dumps(clean(self.to_dict()), indent=2)

    def format(self) -> str:
        """The report as text tables for a terminal."""
        lines = [f"{'version':>7} {'engine':<12} {'rows':>6} {'tokens':>8} {'mean|Δ|':>9} {'p99|Δ|':>9} "
                 f"{'max|Δ|':>9} {'k1':>10} {'k3':>9} {'r mean':>7} {'r p99':>7} {'r max':>8} "
                 f"{'>' + format(self.threshold, 'g'):>7}"]
        for r in self.table.to_pylist():
            lines.append(
                f"{r['weight_version']:>7} {r['engine']:<12} {r['rows']:>6} {r['tokens']:>8} "
                f"{r['mean_abs_diff']:>9.2e} {r['p99_abs_diff']:>9.2e} {r['max_abs_diff']:>9.2e} "
                f"{r['k1']:>10.2e} {r['k3']:>9.2e} {r['ratio_mean']:>7.3f} {r['ratio_p99']:>7.3f} "
                f"{r['ratio_max']:>8.3g} {r['share_above']:>7.2%}"
                + (f"  ({r['unchecked_tokens']} tokens of this version unchecked: no model given)"
                   if r["unchecked_tokens"] else "")
            )
        if self.worst.num_rows:
            lines.append("worst tokens (rollout_id, completion position, stored, recomputed):")
            for w in self.worst.to_pylist():
                lines.append(f"  v{w['weight_version']} {w['rollout_id']} @{w['position']}: "
                             f"{w['stored_logprob']:.5f} vs {w['recomputed_logprob']:.5f} (|Δ| {w['abs_diff']:.3g})")
        if self.experts.num_rows:
            lines.append("routed experts equal to the recomputed router's top-k, per layer:")
            for e in self.experts.to_pylist():
                lines.append(f"  v{e['weight_version']} {e['engine']} layer {e['layer']}: "
                             f"{e['matching']}/{e['positions']} ({e['share']:.2%})")
        for reason, count in sorted(self.skipped.items()):
            lines.append(f"skipped {count} rows: {reason}")
        if self.resumed_rows:
            lines.append(f"{self.resumed_rows} rows resumed from a checkpoint after their worker died "
                         "(checked like the others)")
        return "\n".join(lines)


def build_report(groups: list[GroupStats], experts: list[ExpertStats], skipped: dict[str, int],
                 threshold: float, *, resumed_rows: int = 0) -> VerifyReport:
    groups = sorted(groups, key=lambda g: (g.weight_version, g.engine))
    summary = pa.Table.from_pylist([g.summary() for g in groups], schema=pa.schema(SUMMARY_TYPES))
    worst_rows = sorted((w for g in groups for w in g.worst()), key=lambda w: -w["abs_diff"])
    worst = pa.Table.from_pylist(worst_rows, schema=pa.schema({
        "weight_version": pa.int64(), "engine": pa.string(), "rollout_id": pa.string(), "position": pa.int64(),
        "stored_logprob": pa.float64(), "recomputed_logprob": pa.float64(), "abs_diff": pa.float64()}))
    expert_rows = [row for e in sorted(experts, key=lambda e: (e.weight_version, e.engine)) for row in e.rows()]
    experts_table = pa.Table.from_pylist(expert_rows, schema=pa.schema({
        "weight_version": pa.int64(), "engine": pa.string(), "layer": pa.int64(), "positions": pa.int64(),
        "matching": pa.int64(), "share": pa.float64()}))
    return VerifyReport(summary, worst, experts_table, dict(skipped), threshold, resumed_rows)
