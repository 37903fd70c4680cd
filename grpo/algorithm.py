"""GRPO math as pure tensor functions: no model, no engine, no config object.

Shapes: N = completions in the batch (B prompts x group size G), T = completion tokens, V = vocabulary.
Bad arguments raise ValueError with a message that says what to pass instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

ADVANTAGE_SCALES = ("group", "batch", "none")
from grpo.config.choices import (AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_TYPES,
                                 ROLLOUT_CORRECTIONS, ROLLOUT_MASK_BANDS)
KL_CLAMP = 10.0  # bound on the k3 log-ratio before exp and on k3 itself
LOG_RATIO_CLAMP = 20.0  # bound on a token log-ratio before exp (as verl): exp(88.7) overflows fp32, and inf * 0 is NaN
SEQ_LOG_RATIO_CAP = 10.0  # upper bound on GSPO's sequence log-ratio before exp (as verl)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     batch_std: Optional[float] = None) -> torch.Tensor:
    """Group-relative advantages of a flat reward vector `[B*G]` whose groups are consecutive.

        A_i = (r_i - mean_g) / (std_g + eps)      scale="group"  (GRPO, Shao et al. 2024, sec. 4.1.2)
        A_i = (r_i - mean_g) / (std_batch + eps)  scale="batch"  (group mean, batch std)
        A_i =  r_i - mean_g                        scale="none"   (Dr. GRPO, Liu et al. 2025)
    std is unbiased (torch.std's default). A group whose rewards are all equal gets exactly 0: its numerator is 0.
    `batch_std` is std_batch when the step's batch spans more than `rewards` (other ranks: `reward_std`).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [B*G] vector, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}: pass one reward "
                         f"per completion, {group_size} consecutive completions per prompt")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale '{scale}' (use one of {', '.join(ADVANTAGE_SCALES)})")
    rewards = rewards.float()                                   # [B*G]
    grouped = rewards.view(-1, group_size)                      # [B, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)      # [B, G]
    if scale == "none":
        return centered.reshape(-1)
    if scale == "group":
        # a group of one has no spread (torch.std would give NaN); its centered reward is 0 anyway
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])  # [B, 1]
    elif batch_std is not None:
        std = rewards.new_tensor(batch_std)                                                            # []
    else:
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())                            # []
    return (centered / (std + eps)).reshape(-1)                 # [B*G]


def reward_std(squared_deviations: float, count: float) -> float:
    """Unbiased std of rewards from their squared deviations about the mean (both summed over ranks):
        std = sqrt(sum_i (r_i - mean)^2 / (n - 1)), 0 for n < 2."""
    if count < 2:
        return 0.0
    return math.sqrt(squared_deviations / (count - 1))


def _check_chunking(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()                                           # [n, T, V], a copy only for bf16/fp16 input
    return z / temperature if temperature != 1.0 else z


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 8) -> torch.Tensor:
    """Log-probability of each token under softmax(logits / temperature), in fp32.

        log p(y_t) = z_t[y_t] - logsumexp(z_t),   z_t = logits_t / temperature
    Rows are processed `chunk_size` at a time, so the fp32 copy of the logits (and logsumexp's workspace)
    never covers the whole batch. logits [N, T, V], token_ids [N, T] -> [N, T] fp32; differentiable w.r.t. logits.
    """
    _check_chunking(temperature, chunk_size)
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(f"token_logprobs needs logits [N, T, V] and token_ids [N, T], got "
                         f"{tuple(logits.shape)} and {tuple(token_ids.shape)}")
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        z = _scaled_fp32(logits[start:start + chunk_size], temperature)                        # [n, T, V]
        ids = token_ids[start:start + chunk_size].long().unsqueeze(-1)                          # [n, T, 1]
        out.append(z.gather(-1, ids).squeeze(-1) - torch.logsumexp(z, dim=-1))                 # [n, T]
    return torch.cat(out, dim=0)                                                                # [N, T]


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 8,
                  with_grad: bool = False) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position, chunked over rows.

        H_t = -sum_v p_v log p_v
    logits [N, T, V] -> [N, T] fp32. No gradient (for logging) unless `with_grad` (for an entropy bonus).
    """
    _check_chunking(temperature, chunk_size)
    if logits.dim() != 3:
        raise ValueError(f"token_entropy needs logits [N, T, V], got {tuple(logits.shape)}")
    out = []
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        for start in range(0, logits.shape[0], chunk_size):
            logp = torch.log_softmax(_scaled_fp32(logits[start:start + chunk_size], temperature), dim=-1)  # [n, T, V]
            out.append(-(logp.exp() * logp).sum(dim=-1))                                                  # [n, T]
    return torch.cat(out, dim=0)                                                                            # [N, T]


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) (Schulman, "Approximating KL divergence", 2020):

        k3 = exp(ref - lp) - (ref - lp) - 1       (>= 0; unbiased for samples drawn from pi)
    Two clamps keep one token the policy has moved far from the reference from blowing up the loss:
    the log-ratio (ref - lp) is clamped to [-10, 10] before exp, and the result k3 to [-10, 10].
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-KL_CLAMP, KL_CLAMP)                  # [N, T]
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-KL_CLAMP, KL_CLAMP)      # [N, T]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman 2020), d = lp - ref:

        k1 = d                  (unbiased, can be negative; its sequence sum is the KL-in-reward penalty)
        k2 = 0.5 * d^2          (biased, >= 0; its gradient is that of KL for on-policy samples)
        k3 = exp(-d) + d - 1    ("low_var_kl": unbiased, >= 0, clamped as in kl_k3)
    logprobs / ref_logprobs [N, T] -> [N, T].
    """
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    d = logprobs - ref_logprobs                                                       # [N, T]
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    raise ValueError(f"unknown KL estimator '{estimator}' (use one of {', '.join(KL_ESTIMATORS)})")


def kl_penalized_rewards(rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         mask: torch.Tensor, beta: float) -> torch.Tensor:
    """KL as a reward penalty (PPO-RLHF style, verl's use_kl_in_reward), instead of a loss term:

        r'_i = r_i - beta * sum_t m_it * (lp_it - ref_it)          (the sequence sum of k1)
    rewards [N]; logprobs (the sampling policy's) / ref_logprobs / mask [N, T] -> [N]. No gradient.
    """
    if beta < 0:
        raise ValueError(f"beta (KL coefficient) must be >= 0, got {beta}")
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape or rewards.shape != logprobs.shape[:1]:
        raise ValueError(f"kl_penalized_rewards needs rewards [N] and logprobs / ref_logprobs / mask [N, T], got "
                         f"{tuple(rewards.shape)}, {tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, "
                         f"{tuple(mask.shape)}")
    with torch.no_grad():
        mask = mask.to(device=logprobs.device, dtype=logprobs.dtype)                 # [N, T]
        k1_sum = ((logprobs - ref_logprobs) * mask).sum(dim=1)                      # [N]
        return rewards.float() - beta * k1_sum.float().to(rewards.device)           # [N]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `values` where `mask` is nonzero, over all entries or along `dim`; 0 (not NaN) where the mask is empty.

        masked_mean(x, m) = sum(m * x) / max(sum(m), 1)
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregation_normaliser(mask: torch.Tensor, aggregation: str = "token_mean",
                           max_completion_length: Optional[int] = None) -> float:
    """The denominator D of an aggregation over the rows of `mask` [N, T] (see `aggregate`):

        token_mean:              D = sum_{i,t} m_it                     (completion tokens)
        seq_mean_token_mean:     D = #{i : sum_t m_it > 0}               (sequences with >= 1 token)
        seq_mean_token_sum_norm: D = max_completion_length * #{i : sum_t m_it > 0}   (a constant per sequence)
    A row without tokens (masked out, or a truncated completion under --mask_truncated_completions) counts in
    neither mean. D is additive over disjoint sets of rows: the D of an optimizer step is the sum of the D of its micro-batches
    over all ranks, so each micro-batch can be normalised by the step's D (`aggregate(..., normaliser=D)`).
    """
    _check_aggregation(aggregation, max_completion_length)
    if aggregation == "token_mean":
        return float(mask.sum())
    rows_with_tokens = float((mask.sum(dim=1) > 0).sum())
    if aggregation == "seq_mean_token_mean":
        return rows_with_tokens
    return float(max_completion_length) * rows_with_tokens


def aggregation_numerator(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean") -> torch.Tensor:
    """The numerator S of an aggregation over the rows of `per_token` / `mask` [N, T]; additive over rows:

        token_mean, seq_mean_token_sum_norm:  S = sum_{i,t} m_it x_it
        seq_mean_token_mean:                  S = sum_i sum_t m_it x_it / max(sum_t m_it, 1)
    """
    mask = mask.to(per_token.dtype)                                       # [N, T]
    if aggregation == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=1).sum()                  # rows without tokens add 0
    return (per_token * mask).sum()


def _check_aggregation(aggregation: str, max_completion_length: Optional[int]) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation '{aggregation}' (use one of {', '.join(AGGREGATIONS)})")
    if aggregation == "seq_mean_token_sum_norm" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_completion_length > 0 "
                         f"(the constant that replaces the per-sequence length), got {max_completion_length}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean",
              max_completion_length: Optional[int] = None, normaliser: Optional[float] = None) -> torch.Tensor:
    """Reduce a per-token quantity [N, T] under a mask [N, T] to one number,  S / max(D, 1):

        token_mean:              sum_{i,t} m_it x_it / sum_{i,t} m_it                    (DAPO)
        seq_mean_token_mean:     mean over sequences with >= 1 token of sum_t m_it x_it / sum_t m_it   (GRPO)
        seq_mean_token_sum_norm: mean over sequences with >= 1 token of sum_t m_it x_it / max_completion_length
                                 (Dr. GRPO)
    S = `aggregation_numerator`, D = `normaliser` if given (the whole optimizer step's D, so that the micro-batch
    results sum to the step's aggregate), else `aggregation_normaliser` of these rows.
    """
    _check_aggregation(aggregation, max_completion_length)
    if normaliser is None:
        normaliser = aggregation_normaliser(mask, aggregation, max_completion_length)
    return aggregation_numerator(per_token, mask, aggregation) / max(float(normaliser), 1.0)


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
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type '{loss_type}' (use one of {', '.join(LOSS_TYPES)})")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level '{importance_sampling_level}' "
                         f"(use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})")
    if importance_sampling_level == "sequence" and loss_type in ("cispo", "gmpo"):
        raise ValueError(f"loss_type '{loss_type}' takes token ratios (gmpo forms its own sequence ratio): use "
                         "importance_sampling_level 'token'")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    if clip_ratio_c is not None and loss_type != "ppo_clip":
        raise ValueError(f"clip_ratio_c (dual-clip) applies to loss_type 'ppo_clip' only, got '{loss_type}'")
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
    loss_type: str = "ppo_clip"                   # one of LOSS_TYPES
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
        pg_t    = min(pg_t, -A * clip_ratio_c)   where A < 0                      (dual-clip, ppo_clip only)
        pg_t    = pg_t * w_t                                                      (w = is_weights, or 1)
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
    if loss_type == "cispo":
        pg_per_token = cispo_token_loss(logprobs, ratio, adv, eps_low, eps_high)
    elif loss_type == "sapo":
        pg_per_token = sapo_token_loss(ratio, adv, settings.sapo_tau_pos, settings.sapo_tau_neg)
    elif loss_type == "gmpo":
        pg_per_token = gmpo_sequence_loss(token_log_ratio(logprobs, old_logprobs), adv, mask, eps_low, eps_high)
    else:
        pg_per_token = ppo_clip_token_loss(ratio, adv, eps_low, eps_high)  # [N, T]
    dual_capped = None
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c                                          # [N, 1], > 0 where A < 0
        dual_capped = (adv < 0) & (pg_per_token > cap)                     # [N, T]
        pg_per_token = torch.where(adv < 0, torch.min(pg_per_token, cap), pg_per_token)
    if is_weights is not None:
        pg_per_token = pg_per_token * is_weights.detach().to(logprobs.dtype)
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
        below, above = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high        # [N, T]
        if loss_type == "gmpo":  # its bounds are on the log-ratio
            log_ratio = token_log_ratio(logprobs, old_logprobs)
            below, above = log_ratio < -eps_low, log_ratio > eps_high
        if loss_type == "cispo":  # the weight is clipped whatever the sign of A
            clipped_low, clipped_high = below.to(mask.dtype), above.to(mask.dtype)
        elif loss_type == "sapo":  # no clip: the gate is smooth
            clipped_low = clipped_high = torch.zeros_like(mask)
        else:
            clipped_low, clipped_high = (below & (adv < 0)).to(mask.dtype), (above & (adv > 0)).to(mask.dtype)
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


def _log_bound(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


def rollout_correction(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "token_truncate", cap: float = 2.0, low: Optional[float] = None,
                       high: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w [N, T] (no gradient) for the policy loss that correct for the rollout engine sampling from a
    slightly different policy than the trainer's (the old policy, as the trainer computes it). d_t = old_t - rollout_t
    on masked tokens, D_i = sum_t m_t d_t (the sequence's log-ratio), G_i = D_i / sum_t m_t (its geometric mean):

        token_truncate:    w_t = min(e^d_t, cap)                         (truncated IS, Yao et al. 2025; verl "token")
        sequence_truncate: w_t = min(e^D_i, cap)                         (verl "sequence", TRL sequence_truncate)
        sequence_mask:     w_t = e^D_i if low <= e^D_i <= high else 0    (TRL's default sequence_mask; band 0..3)
        icepop:            w_t = e^d_t if low <= e^d_t <= high else 0    (IcePop, token masking; band 0.5..5)
        geometric_mask:    w_t = 1 if low <= e^G_i <= high else 0        (verl's rollout_rs seq_mean_k1; 0.999..1.001)
    Bounds are compared in log space (e^x is never formed beyond e^20, so nothing overflows). A masked token still
    counts in the loss's denominator (its weight is 0), as in TRL. low / high: None takes ROLLOUT_MASK_BANDS[mode].
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
        if mode == "geometric_mask":
            stat = seq / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        else:
            stat = seq if mode == "sequence_mask" else d
        keep = (stat >= _log_bound(low)) & (stat <= math.log(high))
        value = torch.ones_like(d) if mode == "geometric_mask" else torch.exp(
            stat.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return torch.where(keep, value, torch.zeros_like(d)), nothing, ~keep & (mask > 0)


def _chunk_logprobs_entropy(hidden: torch.Tensor, head, token_ids: torch.Tensor, temperature: float,
                            with_entropy: bool, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    z = _scaled_fp32(head(hidden), temperature)                   # [c, V]  one chunk's logits, fp32
    logz = torch.logsumexp(z, dim=-1)                              # [c]
    logprobs = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - logz   # [c]
    if not with_entropy:
        return logprobs, logprobs.new_zeros(())
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        p = torch.softmax(z, dim=-1)                               # [c, V]
        entropy = logz - (p * z).sum(dim=-1)                       # [c]  H = logsumexp(z) - sum_v p_v z_v
    return logprobs, entropy


def hidden_token_logprobs(hidden: torch.Tensor, head, token_ids: torch.Tensor, temperature: float = 1.0,
                          chunk_tokens: int = 1024, with_entropy: bool = False, entropy_grad: bool = False
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probabilities (and entropies) of tokens from final hidden states, never holding [M, V] logits:

        z_m = head(h_m) / temperature,   log p(y_m) = z_m[y_m] - logsumexp(z_m),   H_m = logsumexp(z_m) - p_m . z_m
    `head` is the output layer (a callable [c, H] -> [c, V]). The M positions are processed `chunk_tokens` at a
    time, each chunk under activation checkpointing: the forward keeps only the chunk's hidden states, the backward
    recomputes the chunk's logits, so peak memory is one chunk's [c, V] fp32 logits instead of [M, V].
    hidden [M, H], token_ids [M] -> logprobs [M] fp32 (differentiable w.r.t. hidden and the head's parameters),
    entropy [M] fp32 (None unless with_entropy), differentiable alike only with `entropy_grad` (an entropy bonus).
    """
    _check_chunking(temperature, chunk_tokens)
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(f"hidden_token_logprobs needs hidden [M, H] and token_ids [M], got "
                         f"{tuple(hidden.shape)} and {tuple(token_ids.shape)}")
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(
        p.requires_grad for p in getattr(head, "parameters", lambda: [])()))
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[start:start + chunk_tokens], head, token_ids[start:start + chunk_tokens], temperature,
                with_entropy, entropy_grad)
        lp, ent = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False) if grad else \
            _chunk_logprobs_entropy(*args)
        logprobs.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    out = torch.cat(logprobs) if logprobs else hidden.new_zeros(0, dtype=torch.float32)
    return out, (torch.cat(entropies) if with_entropy and entropies else None)
