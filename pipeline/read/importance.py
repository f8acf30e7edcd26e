"""Importance weights between the rollout (behaviour) policy and the trainer's policy.

The stored `old_logprobs` are the engine's (the behaviour policy that sampled each token, its
weight version per token); a trainer recomputes `new_logprobs` with its own model. The two
differ — kernels, precision, a partial swap's older tokens — and the policy gradient is biased
unless each token is weighted by the ratio r = π_train / π_rollout = exp(new − old).

- `token_ratios`: r per token on the loss mask (1 elsewhere), detached: a weight, not a path
  for gradients.
- `truncated`: TIS, min(r, cap) — Yao et al., "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training" (2025); verl's `rollout_is` with mode `truncate`.
- `masked`: MIS, tokens (level `token`) or whole sequences (levels `sequence`, `geometric`)
  whose ratio falls outside [lo, hi] leave the loss mask — Liu et al., "When Speed Kills
  Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (2025); verl's
  `rollout_is` with mode `mask`.
- `sequence_ratios`: a sequence's ratio, the product of its tokens' (`sequence`, exp of the sum
  of log ratios) or their geometric mean (`geometric`, exp of the mean).
- `kl_estimates`: Schulman's k1, k2, k3 ("Approximating KL divergence", 2020) over the loss
  mask, for samples from the rollout policy: estimates of KL(π_rollout ‖ π_train) — the figures
  `pipeline verify` reports per weight version.

All take `[B, T]` tensors (the `padded` layout of `collate_rollouts`: `old_logprobs`,
`loss_mask`, aligned with the trainer's `new_logprobs` of the same positions). This module
imports torch: `import pipeline` does not import it.
"""

from __future__ import annotations

from typing import Literal

import torch

from pipeline.core.errors import PipelineError

Level = Literal["token", "sequence", "geometric"]

__all__ = ["kl_estimates", "masked", "sequence_ratios", "token_log_ratios", "token_ratios", "truncated"]


def _check(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    if new_logprobs.shape != old_logprobs.shape or mask.shape != new_logprobs.shape:
        raise PipelineError(f"new_logprobs {tuple(new_logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
                            f"and mask {tuple(mask.shape)} must have one shape ([B, T], the padded layout)")
    if new_logprobs.dim() != 2:
        raise PipelineError(f"importance weights take [B, T] tensors, not {new_logprobs.dim()}-d ones")


def token_log_ratios(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log r = new − old on the mask, 0 elsewhere (detached, float32 or wider)."""
    _check(new_logprobs, old_logprobs, mask)
    delta = new_logprobs.detach().float() - old_logprobs.detach().float()
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))


def token_ratios(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r = exp(new − old) per token on the mask, 1 elsewhere (detached)."""
    return token_log_ratios(new_logprobs, old_logprobs, mask).exp()


def sequence_ratios(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                    level: Level = "sequence") -> torch.Tensor:
    """`[B]`: each sequence's ratio over its masked tokens — the product (`sequence`) or the
    geometric mean (`geometric`); a sequence with no masked token has ratio 1."""
    log_r = token_log_ratios(new_logprobs, old_logprobs, mask)
    total = log_r.sum(dim=-1)
    if level == "sequence":
        return total.exp()
    if level == "geometric":
        count = mask.bool().sum(dim=-1).clamp(min=1)
        return (total / count).exp()
    raise PipelineError(f"sequence ratio level must be 'sequence' or 'geometric', not {level!r}")


def truncated(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0,
              level: Level = "token") -> torch.Tensor:
    """TIS weights, `[B, T]`: min(r, cap) per token (`token`), or each sequence's ratio capped and
    spread over its tokens (`sequence`, `geometric`); 0 outside the mask."""
    if cap <= 0:
        raise PipelineError(f"the TIS cap must be positive, not {cap}")
    weights = _level_ratios(new_logprobs, old_logprobs, mask, level).clamp(max=cap)
    return torch.where(mask.bool(), weights, torch.zeros_like(weights))


def masked(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, lo: float = 0.5,
           hi: float = 2.0, level: Level = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: `(weights, mask)` where tokens (`token`) or whole sequences (`sequence`, `geometric`)
    whose ratio is outside [lo, hi] are dropped from the mask; weights are the ratios kept (0 on
    dropped and unmasked positions)."""
    if not 0 <= lo <= hi:
        raise PipelineError(f"MIS bounds need 0 <= lo <= hi, not lo={lo}, hi={hi}")
    ratios = _level_ratios(new_logprobs, old_logprobs, mask, level)
    keep = mask.bool() & (ratios >= lo) & (ratios <= hi)
    return torch.where(keep, ratios, torch.zeros_like(ratios)), keep


def _level_ratios(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                  level: Level) -> torch.Tensor:
    if level == "token":
        return token_ratios(new_logprobs, old_logprobs, mask)
    per_sequence = sequence_ratios(new_logprobs, old_logprobs, mask, level)
    return per_sequence[:, None].expand_as(new_logprobs)


def kl_estimates(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Means over the masked tokens of k1 = −log r, k2 = (log r)² / 2 and k3 = (r − 1) − log r,
    r = exp(new − old): estimates of KL(π_rollout ‖ π_train) from rollout samples (nan without
    any masked token)."""
    log_r = token_log_ratios(new_logprobs, old_logprobs, mask).double()
    keep = mask.bool()
    n = int(keep.sum())
    if not n:
        return {"k1": float("nan"), "k2": float("nan"), "k3": float("nan")}
    values = log_r[keep]
    return {
        "k1": float((-values).sum() / n),
        "k2": float((values.square() / 2).sum() / n),
        "k3": float((values.exp() - 1 - values).sum() / n),
    }
