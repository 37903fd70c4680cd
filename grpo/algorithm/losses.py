"""The policy losses: PPO-clip (token or sequence importance ratio), CISPO, SAPO, GMPO, with KL and entropy terms.

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo.algorithm.aggregation import aggregate, masked_mean
from grpo.algorithm.kl import kl_estimate
from grpo.algorithm.registry import (IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LossTerms, get_policy_loss,
                                    policy_losses_taking)


LOG_RATIO_CLAMP = 20.0  # bound on a token log-ratio before exp (as verl): exp(88.7) overflows fp32, and inf * 0 is NaN


SEQ_LOG_RATIO_CAP = 10.0  # upper bound on GSPO's sequence log-ratio before exp (as verl)


def _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, is_weights, entropy,
                       settings: LossSettings):
    eps_low, eps_high, beta = settings.eps_low, settings.upper_eps, settings.beta
    importance_sampling_level, clip_ratio_c = settings.importance_sampling_level, settings.clip_ratio_c
    kl_estimator, entropy_coef, loss_type = settings.kl_estimator, settings.entropy_coef, settings.loss_type
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "is_weights": is_weights,
             "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, "
                             f"got {tuple(tensor.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N] = {tuple(logprobs.shape[:1])} (one per sequence), "
                         f"got {tuple(advantages.shape)}")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {eps_low} and {eps_high}")
    if beta < 0:
        raise ValueError(f"beta (KL coefficient) must be >= 0, got {beta}")
    chosen = get_policy_loss(loss_type)  # ValueError naming the registered ones
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level '{importance_sampling_level}' "
                         f"(use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")
    if importance_sampling_level == "sequence" and not chosen.sequence_ratio:
        raise ValueError(f"loss_type '{loss_type}' takes token ratios (gmpo forms its own sequence ratio): use "
                         "importance_sampling_level 'token'")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    if clip_ratio_c is not None and not chosen.dual_clip:
        takes = " / ".join(f"'{name}'" for name in policy_losses_taking("dual_clip"))
        raise ValueError(f"clip_ratio_c (dual-clip) applies to loss_type {takes} only, got '{loss_type}'")
    if not (settings.sapo_tau_pos > 0 and settings.sapo_tau_neg > 0):
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos {settings.sapo_tau_pos} and "
                         f"tau_neg {settings.sapo_tau_neg}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator '{kl_estimator}' (use one of {', '.join(KL_ESTIMATORS)})")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy [N, T] (computed with gradient)")


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log r_it = clamp(lp_it - old_it, -20, 20)  # [N, T]; gradient through lp only (none where clamped).
    The clamp (verl's) keeps exp finite: a padded or far-off position with lp - old > 88 would give inf, and the
    mask's 0 * inf a NaN loss."""
    return (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """The PPO importance ratio per token  # [N, T].

        token:    r_it = exp(clamp(lp_it - old_it, -20, 20))
        sequence: r_it = s_i = exp(min(sum_t m_it (lp_it - old_it) / sum_t m_it, 10))   for every t  (GSPO, Zheng
                  et al. 2025, arXiv:2507.18071; the cap at 10 is verl's)
    The sequence ratio is the geometric mean of the token ratios over the sequence's own (masked) tokens, so a long
    and a short completion are on the same scale; its gradient reaches every token of the sequence.
    """
    if level == "token":
        return torch.exp(token_log_ratio(logprobs, old_logprobs))
    if level == "sequence":
        mask = mask.to(logprobs.dtype)
        log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))  # [N, T]
        seq_log_ratio = log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)                       # [N]
        return torch.exp(seq_log_ratio.clamp(max=SEQ_LOG_RATIO_CAP)).unsqueeze(1).expand_as(log_ratio)
    raise ValueError(f"unknown importance_sampling_level '{level}' "
                     f"(use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")


def ppo_clip_token_loss(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with DAPO's decoupled upper bound (Yu et al. 2025):

        pg_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
    ratio [N, T], adv [N, 1] -> [N, T]."""
    return -torch.min(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


def cispo_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, eps_low: float,
                     eps_high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4): the importance weight is clipped and its gradient stopped, and
    every token keeps a REINFORCE gradient (none is dropped, as PPO's clip drops the clipped ones):

        pg_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * lp_t          (verl's cispo)
        d pg_t / d lp_t = -clip(r_t, ...) * A
    TRL's cispo clips only above, at its epsilon_high (5 recommended): eps_high = 4 and eps_low near 1 here.
    logprobs / ratio [N, T], adv [N, 1] -> [N, T]."""
    return -ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach() * adv * logprobs


def sapo_token_loss(ratio: torch.Tensor, adv: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05
                    ) -> torch.Tensor:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a smooth gate instead of the hard clip,

        f(r) = (4 / tau) * sigmoid(tau * (r - 1)),   tau = tau_pos if A > 0 else tau_neg
        pg_t = -f(r_t) * A
    f'(r) = 4 sigmoid(.) (1 - sigmoid(.)): 1 at r = 1 (the policy gradient on-policy), fading smoothly as r leaves 1;
    a larger tau fades faster (tau_neg > tau_pos damps negative updates more). Defaults are verl's and TRL's.
    ratio [N, T], adv [N, 1] -> [N, T]."""
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # [N, 1]
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv


def gmpo_sequence_loss(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float,
                       eps_high: float) -> torch.Tensor:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the token ratios, each clipped in log space,
    replaces their arithmetic mean, so one outlier token moves the sequence's objective less:

        l'_t  = sgn(A) * min(sgn(A) l_t, sgn(A) clip(l_t, -eps_low, eps_high))    (l_t = log r_t; PPO's pessimism)
        R_i   = exp( sum_t m_t l'_t / sum_t m_t )
        pg_i  = -A_i * R_i,  the same at every token of sequence i                 (verl's geo_mean)
    Averaged over each sequence's tokens (seq_mean_token_mean, as verl), the loss is mean_i pg_i. The paper's range
    is eps = 0.4 (ratios within e^-0.4 .. e^0.4). log_ratio / mask [N, T], adv [N, 1] -> [N, T]."""
    sign = torch.sign(adv)                                                                      # [N, 1]
    kept = sign * torch.min(sign * log_ratio, sign * log_ratio.clamp(-eps_low, eps_high))      # [N, T]
    kept = torch.where(mask > 0, kept, torch.zeros_like(kept))
    seq_ratio = torch.exp(kept.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0))  # [N, 1]
    return (-adv * seq_ratio).expand_as(log_ratio)


GMPO_WEIGHT_FLOOR = 1e-10  # added to a weight before its log in gmpo's geometric mean (verl's), so log 0 is finite


def gmpo_sequence_weights(is_weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GMPO's weight of a sequence from per-token correction weights w_t: their geometric mean, as verl's geo_mean
    aggregates rollout_is_weights (a per-token weight would break the sequence's single ratio):

        W_i = exp( sum_t m_t log(w_t + 1e-10) / sum_t m_t ),   0 where every w_t of the sequence is 0
    A token weight of 0 (icepop) thus scales its sequence by (1e-10)^(1/n_i), not to 0: one such token of 100 gives
    0.79. Sequence-wide weights (sequence_truncate, sequence_mask, geometric_mask) are their own geometric mean.
    is_weights / mask [N, T] -> [N, T] (W_i at every token of i)."""
    mask = mask.to(is_weights.dtype)
    logs = torch.where(mask > 0, torch.log(is_weights + GMPO_WEIGHT_FLOOR), torch.zeros_like(is_weights))  # [N, T]
    seq = torch.exp(logs.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0))          # [N, 1]
    rejected = ((is_weights == 0) | (mask == 0)).all(dim=1, keepdim=True) & (mask > 0).any(dim=1, keepdim=True)
    return torch.where(rejected, torch.zeros_like(seq), seq).expand_as(is_weights)


@dataclass(frozen=True)
class LossSettings:
    """The loss's scalar settings (policy_loss documents each)."""
    eps_low: float = 0.2                          # PPO clip: ratio kept above 1 - eps_low
    eps_high: Optional[float] = None              # ... and below 1 + eps_high (None: eps_low; DAPO 0.28)
    beta: float = 0.0                             # KL coefficient (0: KL logged, not in the loss)
    kl_estimator: str = "k3"                      # one of KL_ESTIMATORS
    aggregation: str = "token_mean"               # one of AGGREGATIONS
    max_completion_length: Optional[int] = None   # the constant of seq_mean_token_sum_norm
    importance_sampling_level: str = "token"      # token (PPO) or sequence (GSPO)
    clip_ratio_c: Optional[float] = None          # dual-clip bound (> 1), None = off
    entropy_coef: float = 0.0                     # entropy bonus
    loss_type: str = "ppo_clip"                   # a registered policy loss (registry.py, loss_types.py)
    sapo_tau_pos: float = 1.0                     # SAPO gate temperature where A > 0
    sapo_tau_neg: float = 1.05                    # ... and where A <= 0

    @property
    def upper_eps(self) -> float:
        return self.eps_low if self.eps_high is None else self.eps_high


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                settings: LossSettings = LossSettings(), *, ref_logprobs: Optional[torch.Tensor] = None,
                is_weights: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                normaliser: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """GRPO's policy loss with an optional KL penalty and entropy bonus, masked and aggregated over the rows.

        ratio_t = importance_ratio(lp, old, mask, importance_sampling_level)     (token: exp(lp_t - old_t))
        pg_t    = ppo_clip_token_loss(ratio, A, eps_low, eps_high)                loss_type ppo_clip (GRPO, DAPO, GSPO)
                | cispo_token_loss(lp, ratio, A, eps_low, eps_high)                loss_type cispo
                | sapo_token_loss(ratio, A, tau_pos, tau_neg)                      loss_type sapo
                | gmpo_sequence_loss(log ratio, A, mask, eps_low, eps_high)       loss_type gmpo (eps in log space)
                | the loss registered as loss_type (@register_policy_loss; the ones above: loss_types.py)
        pg_t    = min(pg_t, -A * clip_ratio_c)   where A < 0                      (dual-clip, ppo_clip only)
        pg_t    = pg_t * w_t                                                      (w = is_weights, or 1)
                  (gmpo: w_t = gmpo_sequence_weights(w, mask), the sequence's geometric mean)
        loss_t  = pg_t + beta * kl_t - entropy_coef * H_t                         (kl_t = kl_estimate(lp, ref))
        loss    = aggregate(loss_t, mask, aggregation)
    Dual-clip (Ye et al. 2020, as in verl) bounds the loss of a negative-advantage token whose ratio has grown large:
    -A * ratio would be unbounded, and is capped at -A * clip_ratio_c (> 1).
    `is_weights` is the rollout/trainer mismatch correction (`rollout_correction`). `entropy` [N, T] is
    the policy's token entropy, with gradient when entropy_coef != 0 (a positive coef rewards higher entropy).
    logprobs / old_logprobs / ref_logprobs / mask / is_weights / entropy: [N, T]; advantages: [N], broadcast over
    tokens; `settings`: the scalar ones (LossSettings). Gradients flow only through `logprobs` (and `entropy`).
    Called per micro-batch, the loss aggregates those rows only, unless `normaliser` is the optimizer step's
    denominator D (`aggregation_normaliser` summed over all micro-batches and ranks): then the micro-batch losses
    sum to the loss of the whole step, however it was split.

    Returns (loss, metrics); metrics are python floats over masked tokens: clip_frac_low, clip_frac_high (tokens
    whose clip bound held: ppo_clip and gmpo where the pessimistic side is the clipped one, A < 0 below and A > 0
    above; cispo where the weight was clipped, any A; 0 for sapo), clip_frac (their sum), clip_frac_dual
    (tokens whose loss the dual clip capped), ratio_mean, ratio_max, kl (mean of the chosen estimator whenever
    ref_logprobs is given, else 0.0), pg_loss (pg_t alone, aggregated alike) and, with entropy_coef, entropy_loss
    (-entropy_coef * H aggregated alike).
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, is_weights, entropy, settings)
    eps_low, eps_high, beta = settings.eps_low, settings.upper_eps, settings.beta
    aggregation, max_completion_length = settings.aggregation, settings.max_completion_length
    clip_ratio_c, entropy_coef, loss_type = settings.clip_ratio_c, settings.entropy_coef, settings.loss_type
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)             # [N, 1]
    mask = mask.to(logprobs.dtype)                                         # [N, T]

    ratio = importance_ratio(logprobs, old_logprobs, mask, settings.importance_sampling_level)  # [N, T]
    chosen = get_policy_loss(loss_type)
    pg_per_token, clipped_low, clipped_high = chosen.fn(
        LossTerms(logprobs, old_logprobs, ratio, adv, mask, eps_low, eps_high, settings))   # [N, T] each
    dual_capped = None
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c                                          # [N, 1], > 0 where A < 0
        dual_capped = (adv < 0) & (pg_per_token > cap)                     # [N, T]
        pg_per_token = torch.where(adv < 0, torch.min(pg_per_token, cap), pg_per_token)
    if is_weights is not None:
        weights = is_weights.detach().to(logprobs.dtype)                   # [N, T]
        if chosen.sequence_weights:  # one weight per sequence: the geometric mean of its tokens' (verl's geo_mean)
            weights = gmpo_sequence_weights(weights, mask)
        pg_per_token = pg_per_token * weights
    per_token = pg_per_token
    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs.detach(), settings.kl_estimator)    # [N, T]
        if beta > 0:
            per_token = per_token + beta * kl
    if entropy_coef != 0.0:
        per_token = per_token - entropy_coef * entropy.to(logprobs.dtype)
    loss = aggregate(per_token, mask, aggregation, max_completion_length, normaliser=normaliser)

    with torch.no_grad():
        # the tokens whose clip bound held, as the loss counts them (none for a loss without a clip: sapo)
        clipped_low, clipped_high = (torch.zeros_like(mask) if clipped is None else clipped.to(mask.dtype)
                                     for clipped in (clipped_low, clipped_high))
        metrics = {
            "clip_frac_low": masked_mean(clipped_low, mask).item(),
            "clip_frac_high": masked_mean(clipped_high, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask > 0].max().item() if mask.any() else 0.0,
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "pg_loss": aggregate(pg_per_token, mask, aggregation, max_completion_length, normaliser).item(),
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if dual_capped is not None:
            metrics["clip_frac_dual"] = masked_mean(dual_capped.to(mask.dtype), mask).item()
        if entropy_coef != 0.0:
            metrics["entropy_loss"] = aggregate(-entropy_coef * entropy.detach().to(mask.dtype), mask, aggregation,
                                                max_completion_length, normaliser).item()
    return loss, metrics
