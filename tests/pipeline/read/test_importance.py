"""Importance weights (TIS, MIS, sequence ratios, KL estimators) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.errors import PipelineError
from pipeline.read.importance import kl_estimates, masked, sequence_ratios, token_ratios, truncated

LN2 = math.log(2.0)
# Two sequences, three positions; the second's last position is padding.
#   sequence 0: log ratios  ln 2, -ln 2, ln 4   -> ratios 2, 0.5, 4
#   sequence 1: log ratios  0,     ln 3, (pad)  -> ratios 1, 3
OLD = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0]])
NEW = OLD + torch.tensor([[LN2, -LN2, 2 * LN2], [0.0, math.log(3.0), 5.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def close(got: torch.Tensor, want: list) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=1e-5, atol=1e-6)


def test_token_ratios_are_one_off_the_mask_and_carry_no_gradient() -> None:
    new = NEW.clone().requires_grad_(True)
    ratios = token_ratios(new, OLD, MASK)
    close(ratios, [[2.0, 0.5, 4.0], [1.0, 3.0, 1.0]])
    assert not ratios.requires_grad


def test_sequence_and_geometric_ratios() -> None:
    close(sequence_ratios(NEW, OLD, MASK), [2 * 0.5 * 4, 1 * 3])          # products: 4, 3
    close(sequence_ratios(NEW, OLD, MASK, "geometric"), [4 ** (1 / 3), 3 ** 0.5])
    empty = torch.zeros_like(MASK)
    close(sequence_ratios(NEW, OLD, empty), [1.0, 1.0])
    close(sequence_ratios(NEW, OLD, empty, "geometric"), [1.0, 1.0])


def test_tis_caps_each_tokens_ratio_and_zeroes_padding() -> None:
    close(truncated(NEW, OLD, MASK, cap=2.5), [[2.0, 0.5, 2.5], [1.0, 2.5, 0.0]])
    close(truncated(NEW, OLD, MASK, cap=3.5, level="sequence"), [[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]])


def test_mis_drops_tokens_or_whole_sequences_outside_the_bounds() -> None:
    weights, keep = masked(NEW, OLD, MASK, lo=0.6, hi=3.0)
    assert keep.tolist() == [[True, False, False], [True, True, False]]
    close(weights, [[2.0, 0.0, 0.0], [1.0, 3.0, 0.0]])
    # Sequence level: sequence 0's product 4 is above hi=3.5, sequence 1's 3 is kept.
    weights, keep = masked(NEW, OLD, MASK, lo=0.5, hi=3.5, level="sequence")
    assert keep.tolist() == [[False, False, False], [True, True, False]]
    close(weights, [[0.0, 0.0, 0.0], [3.0, 3.0, 0.0]])
    # Geometric: 4^(1/3) = 1.587 and 3^(1/2) = 1.732; hi=1.65 keeps only sequence 0.
    _, keep = masked(NEW, OLD, MASK, lo=0.5, hi=1.65, level="geometric")
    assert keep.tolist() == [[True, True, True], [False, False, False]]


def test_kl_estimators_by_hand() -> None:
    logs = [LN2, -LN2, 2 * LN2, 0.0, math.log(3.0)]  # the masked tokens' log ratios
    want = {
        "k1": sum(-x for x in logs) / 5,
        "k2": sum(x * x / 2 for x in logs) / 5,
        "k3": sum(math.exp(x) - 1 - x for x in logs) / 5,
    }
    got = kl_estimates(NEW, OLD, MASK)
    assert got == pytest.approx(want, rel=1e-6)
    assert got["k3"] > 0  # never negative, unlike k1
    assert all(math.isnan(v) for v in kl_estimates(NEW, OLD, torch.zeros_like(MASK)).values())


def test_bad_inputs_are_refused_clearly() -> None:
    with pytest.raises(PipelineError, match="must have one shape"):
        token_ratios(NEW, OLD[:, :2], MASK)
    with pytest.raises(PipelineError, match="cap must be positive"):
        truncated(NEW, OLD, MASK, cap=0)
    with pytest.raises(PipelineError, match="lo <= hi"):
        masked(NEW, OLD, MASK, lo=2, hi=1)
    with pytest.raises(PipelineError, match="'sequence' or 'geometric'"):
        sequence_ratios(NEW, OLD, MASK, "token")  # type: ignore[arg-type]
