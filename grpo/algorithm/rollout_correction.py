"""Corrections for the mismatch between the rollout engine's and the trainer's log-probabilities: the built-in ones,
each registered by name (registry.py, @register_rollout_correction), and rollout_correction, which computes the one
named. The command line reads this file for the names before torch loads: the math takes its torch from the tensors
it is given (torch itself loads in rollout_correction, which the config never calls).

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from grpo.algorithm.registry import (DEFAULT_ROLLOUT_CORRECTION, CorrectionTerms, get_rollout_correction,
                                     register_rollout_correction)

if TYPE_CHECKING:
    import torch


def _log_bound(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def _clamped(log_ratio):
    """A log-ratio clamped to +-LOG_RATIO_CLAMP (20, as the losses' ratios) before exp, so nothing overflows."""
    from grpo.algorithm.losses import LOG_RATIO_CLAMP

    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _truncated(log_w, cap: float) -> tuple:
    capped = log_w > math.log(cap)
    return _clamped(log_w).exp().clamp(max=cap), capped, None


def _band_kept(stat, c: CorrectionTerms):
    return (stat >= _log_bound(c.low)) & (stat <= math.log(c.high))


@register_rollout_correction("token_truncate", help="the default: min(ratio, cap) per token")
def token_truncate(c: CorrectionTerms) -> tuple:
    """w_t = min(e^d_t, cap): truncated IS (Yao et al. 2025; verl "token")."""
    return _truncated(c.log_ratio, c.cap)


@register_rollout_correction("sequence_truncate", help="the sequence's ratio, capped")
def sequence_truncate(c: CorrectionTerms) -> tuple:
    """w_t = min(e^D_i, cap) (verl "sequence", TRL sequence_truncate)."""
    return _truncated(c.seq_log_ratio, c.cap)


@register_rollout_correction("sequence_mask", band=(0.0, 3.0),
                             help="the sequence's ratio, 0 outside --rollout_mask_low/high; TRL's default")
def sequence_mask(c: CorrectionTerms) -> tuple:
    """w_t = e^D_i if low <= e^D_i <= high else 0 (TRL's default sequence_mask)."""
    keep = _band_kept(c.seq_log_ratio, c)
    return _clamped(c.seq_log_ratio).exp().masked_fill(~keep, 0.0), None, ~keep


@register_rollout_correction("icepop", band=(0.5, 5.0), help="the token's ratio, 0 outside the band")
def icepop(c: CorrectionTerms) -> tuple:
    """w_t = e^d_t if low <= e^d_t <= high else 0 (IcePop, token masking)."""
    keep = _band_kept(c.log_ratio, c)
    return _clamped(c.log_ratio).exp().masked_fill(~keep, 0.0), None, ~keep


@register_rollout_correction("geometric_mask", band=(0.999, 1.001),
                             help="weight 1, 0 where the sequence's geometric mean of rollout / trainer probability "
                                  "is outside the band, as verl's seq_mean_k1")
def geometric_mask(c: CorrectionTerms) -> tuple:
    """w_t = 1 if low <= e^K_i <= high else 0 (verl's rollout_rs seq_mean_k1), K_i the mean of -d_t over the
    sequence, each d_t capped first (verl's)."""
    k1 = -_clamped(c.log_ratio)                                                                          # [N, T]
    stat = k1.sum(dim=1, keepdim=True).expand_as(k1) / c.mask.sum(dim=1, keepdim=True).clamp(min=1.0)    # [N, T]
    keep = _band_kept(stat, c)
    return k1.new_ones(k1.shape).masked_fill(~keep, 0.0), None, ~keep


def rollout_correction(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = DEFAULT_ROLLOUT_CORRECTION, cap: float = 2.0, low: Optional[float] = None,
                       high: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w [N, T] (no gradient) for the policy loss that correct for the rollout engine sampling from a
    slightly different policy than the trainer's (the old policy, as the trainer computes it). d_t = old_t - rollout_t
    on masked tokens, D_i = sum_t m_t d_t (the sequence's log-ratio), n_i = sum_t m_t, and
    K_i = sum_t m_t (-clamp(d_t, -20, 20)) / n_i (the mean k1 estimate, -log of the geometric-mean ratio); `mode`
    names a registered correction (@register_rollout_correction), the built-in ones:

        token_truncate:    w_t = min(e^d_t, cap)                         (truncated IS, Yao et al. 2025; verl "token")
        sequence_truncate: w_t = min(e^D_i, cap)                         (verl "sequence", TRL sequence_truncate)
        sequence_mask:     w_t = e^D_i if low <= e^D_i <= high else 0    (TRL's default sequence_mask; band 0..3)
        icepop:            w_t = e^d_t if low <= e^d_t <= high else 0    (IcePop, token masking; band 0.5..5)
        geometric_mask:    w_t = 1 if low <= e^K_i <= high else 0        (verl's rollout_rs seq_mean_k1; 0.999..1.001)
    geometric_mask is verl's test as verl writes it: the band holds e^K_i = (prod_t rollout_p / trainer_p)^(1/n_i),
    the geometric mean of the inverse ratio, each token's log-ratio capped at +-20 first; a band that is not
    symmetric in log space (0.9 .. 1.2) keeps geometric-mean ratios e^-K_i in 1/1.2 .. 1/0.9 = 0.833 .. 1.111.
    Bounds are compared in log space (e^x is never formed beyond e^20, so nothing overflows). A masked token still
    counts in the loss's denominator (its weight is 0), as in TRL; verl's rejection (rollout_rs) instead removes it
    from the mask, and so from the denominator (docs/algorithm.md). low / high: None takes the correction's band.
    Returns (w, capped, masked): capped [N, T] bool where a truncating mode cut the weight to `cap`, masked [N, T]
    bool where a masking mode set it to 0 (on completion tokens only).
    """
    import torch

    chosen = get_rollout_correction(mode)  # ValueError naming the registered ones
    if chosen.band is not None:
        low, high = chosen.band[0] if low is None else low, chosen.band[1] if high is None else high
        if not 0.0 <= low < high:
            raise ValueError(f"rollout mask band needs 0 <= low < high, got {low} and {high}")
    else:
        low = high = None
    mask = mask.to(trainer_logprobs.dtype)
    with torch.no_grad():
        d = torch.where(mask > 0, trainer_logprobs - rollout_logprobs, torch.zeros_like(trainer_logprobs))  # [N, T]
        seq = d.sum(dim=1, keepdim=True).expand_as(d)                                                     # [N, T]
        w, capped, masked = chosen.fn(CorrectionTerms(d, seq, mask, cap, low, high))
        nothing = torch.zeros_like(d, dtype=torch.bool)
        capped = nothing if capped is None else capped
        masked = nothing if masked is None else masked & (mask > 0)
        return w, capped, masked
