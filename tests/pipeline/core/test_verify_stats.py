"""`pipeline verify`'s streaming figures against hand computations and the torch helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.core.verify_stats import GroupStats, Quantiles, build_report
from pipeline.read.importance import kl_estimates


def test_group_figures_by_hand() -> None:
    stats = GroupStats(weight_version=3, engine="hf", model="/m", threshold=0.5, worst_kept=1)
    stored = np.array([-1.0, -2.0, -0.5], np.float32)
    delta = np.array([0.1, -0.7, 0.0])
    stats.add("a:0", np.arange(3), stored, stored + delta)
    stats.add("b:0", np.array([4]), np.array([-3.0], np.float32), np.array([-1.0], np.float32))  # Δ = 2
    s = stats.summary()
    every = np.array([0.1, -0.7, 0.0, 2.0])
    assert s["tokens"] == 4 and s["nonfinite_tokens"] == 0
    assert s["mean_abs_diff"] == pytest.approx(np.abs(every).mean(), rel=1e-6)
    assert s["max_abs_diff"] == pytest.approx(2.0, rel=1e-6)
    assert s["share_above"] == 0.5  # 0.7 and 2.0 are above 0.5
    assert s["ratio_mean"] == pytest.approx(np.exp(every).mean(), rel=1e-6)
    assert s["ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    torch_kl = kl_estimates(torch.tensor(every[None]), torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert (s["k1"], s["k3"]) == pytest.approx((torch_kl["k1"], torch_kl["k3"]), rel=1e-6)
    (worst,) = stats.worst()
    assert (worst["rollout_id"], worst["position"], worst["stored_logprob"], worst["recomputed_logprob"]) == (
        "b:0", 4, -3.0, -1.0)


def test_a_non_finite_recomputation_is_the_worst_and_fails_any_gate() -> None:
    stats = GroupStats(0, "hf", "/m", 0.1)
    stats.add("a:0", np.arange(2), np.array([-1.0, -1.0], np.float32), np.array([-1.0, -np.inf], np.float32))
    report = build_report([stats], [], {}, 0.1)
    assert report.max_abs_diff == math.inf and report.table.column("nonfinite_tokens").to_pylist() == [1]
    assert report.worst.to_pylist()[0]["position"] == 1
    assert '"max_abs_diff": null' in report.to_json()  # JSON has no inf


def test_quantiles_are_within_a_bin_of_the_exact_value() -> None:
    values = np.random.default_rng(0).lognormal(-6, 2, 100_000)
    q = Quantiles()
    for part in np.array_split(values, 7):
        q.add(part)
    exact = np.quantile(values, 0.99, method="inverted_cdf")
    assert exact <= q.quantile(0.99) <= exact * 10 ** (1 / 100) * 1.0001
    signed = Quantiles()
    signed.add(np.array([-3.0, -2.0, -1.0, 0.0]))
    assert signed.quantile(0.5) == pytest.approx(-2.0, rel=0.03) and signed.quantile(1.0) == 0.0
