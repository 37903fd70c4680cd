"""Corrections for the mismatch between the rollout engine's and the trainer's log-probabilities.

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from grpo.algorithm.losses import LOG_RATIO_CLAMP
from grpo.algorithm.registry import ROLLOUT_CORRECTIONS, ROLLOUT_MASK_BANDS


def _log_bound(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def rollout_correction(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "token_truncate", cap: float = 2.0, low: Optional[float] = None,
                       high: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w [N, T] (no gradient) for the policy loss that correct for the rollout engine sampling from a
    slightly different policy than the trainer's (the old policy, as the trainer computes it). d_t = old_t - rollout_t
    on masked tokens, D_i = sum_t m_t d_t (the sequence's log-ratio), n_i = sum_t m_t, and
    K_i = sum_t m_t (-clamp(d_t, -20, 20)) / n_i (the mean k1 estimate, -log of the geometric-mean ratio):

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
    from the mask, and so from the denominator (docs/algorithm.md). low / high: None takes ROLLOUT_MASK_BANDS[mode].
    Returns (w, capped, masked): capped [N, T] bool where a truncating mode cut the weight to `cap`, masked [N, T]
    bool where a masking mode set it to 0.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction '{mode}' (use one of {', '.join(ROLLOUT_CORRECTIONS)})")
    mask = mask.to(trainer_logprobs.dtype)
    with torch.no_grad():
        d = torch.where(mask > 0, trainer_logprobs - rollout_logprobs, torch.zeros_like(trainer_logprobs))  # [N, T]
        seq = d.sum(dim=1, keepdim=True).expand_as(d)                                                     # [N, T]
        nothing = torch.zeros_like(d, dtype=torch.bool)
        if mode in ("token_truncate", "sequence_truncate"):
            log_w = d if mode == "token_truncate" else seq
            capped = log_w > math.log(cap)
            return torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap), capped, nothing
        band_low, band_high = ROLLOUT_MASK_BANDS[mode]
        low, high = band_low if low is None else low, band_high if high is None else high
        if not 0.0 <= low < high:
            raise ValueError(f"rollout mask band needs 0 <= low < high, got {low} and {high}")
        if mode == "geometric_mask":  # K_i: the mean of -d_t over the sequence, each d_t capped first (verl's)
            k1 = -d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)                                                 # [N, T]
            stat = k1.sum(dim=1, keepdim=True).expand_as(d) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, T]
        else:
            stat = seq if mode == "sequence_mask" else d
        keep = (stat >= _log_bound(low)) & (stat <= math.log(high))
        value = torch.ones_like(d) if mode == "geometric_mask" else torch.exp(
            stat.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return torch.where(keep, value, torch.zeros_like(d)), nothing, ~keep & (mask > 0)
