"""GRPO math as pure tensor functions: no model, no engine, no config object.

Shapes: N = completions in the batch (prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
LOG_RATIO_CLAMP = 10.0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages of a flat reward vector whose groups are consecutive.

        A_i = (r_i - mean_g) / (std_g + eps)      scale="group"  (GRPO, std unbiased as torch.std)
        A_i = (r_i - mean_g) / (std_batch + eps)  scale="batch"
        A_i =  r_i - mean_g                        scale="none"   (Dr. GRPO)
    A group whose rewards are all equal gets exactly 0 (its numerator is 0).
    """
    rewards = rewards.float()                                  # [N]
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)                     # [N/G, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)     # [N/G, G]
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        advantages = centered / (std + eps)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = centered / (std + eps)
    elif scale == "none":
        advantages = centered
    else:
        raise ValueError(f"unknown advantage scale '{scale}' (use group, batch or none)")
    return advantages.reshape(-1)                              # [N]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 8) -> torch.Tensor:
    """log softmax(logits / temperature)[token] for every position, in fp32.

        log p(y_t) = z_t[y_t] - logsumexp(z_t),   z_t = logits_t / temperature
    Rows are processed `chunk_size` at a time so the fp32 copy of the logits never covers the whole batch.
    logits [N, T, V], token_ids [N, T] -> [N, T]; differentiable w.r.t. logits.
    """
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        z = logits[start:start + chunk_size].float() / temperature                  # [n, T, V]
        picked = z.gather(-1, token_ids[start:start + chunk_size].unsqueeze(-1)).squeeze(-1)  # [n, T]
        out.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(out, dim=0)                                                    # [N, T]


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 8) -> torch.Tensor:
    """H_t = -sum_v p_v log p_v of softmax(logits / temperature), per position. [N, T, V] -> [N, T]."""
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        logp = torch.log_softmax(logits[start:start + chunk_size].float() / temperature, dim=-1)  # [n, T, V]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out, dim=0)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref) (Schulman, "Approximating KL divergence"):

        k3 = exp(ref - lp) - (ref - lp) - 1     (>= 0, unbiased, low variance)
    The log-ratio (ref - lp) is clamped to [-10, 10] before exp, and k3 itself to [-10, 10], so one
    token the policy has moved far from the reference cannot blow up the loss.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of values where mask is 1 (0 where the mask is empty, not NaN)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token_mean",
              max_completion_length: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token quantity [N, T] to one number.

        token_mean:              sum_{i,t} m_it x_it / sum_{i,t} m_it
        seq_mean_token_mean:     mean over sequences with >= 1 token of (sum_t m_it x_it / sum_t m_it)
        seq_mean_token_sum_norm: mean_i (sum_t m_it x_it / max_completion_length)       (Dr. GRPO)
    """
    mask = mask.to(per_token.dtype)
    if aggregation == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregation == "seq_mean_token_mean":
        tokens = mask.sum(dim=1)                                         # [N]
        has_tokens = tokens > 0
        per_seq = (per_token * mask).sum(dim=1) / tokens.clamp(min=1.0)  # [N]
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)
    if aggregation == "seq_mean_token_sum_norm":
        if not max_completion_length:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_completion_length")
        return ((per_token * mask).sum(dim=1) / max_completion_length).mean()
    raise ValueError(f"unknown loss aggregation '{aggregation}' (use one of {', '.join(AGGREGATIONS)})")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                ref_logprobs: Optional[torch.Tensor] = None, beta: float = 0.0, eps_low: float = 0.2,
                eps_high: Optional[float] = None, aggregation: str = "token_mean",
                max_completion_length: Optional[int] = None,
                is_weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """PPO-clipped GRPO surrogate with an optional k3 KL penalty, masked and aggregated.

        ratio_t = exp(lp_t - old_t)
        pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A) * w_t    (w: is_weights or 1)
        loss_t  = pg_t + beta * k3(lp_t, ref_t)
    logprobs / old_logprobs / ref_logprobs / mask / is_weights: [N, T]; advantages: [N].
    Gradients flow only through `logprobs`. Returns (loss, metrics) with metrics as python floats:
    clip_frac_low (A < 0 and ratio < 1 - eps_low), clip_frac_high (A > 0 and ratio > 1 + eps_high), clip_frac,
    ratio_mean, ratio_max, kl, pg_loss.
    """
    eps_high = eps_low if eps_high is None else eps_high
    old_logprobs = old_logprobs.detach()
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)             # [N, 1]
    mask = mask.to(logprobs.dtype)                                         # [N, T]
    ratio = torch.exp(logprobs - old_logprobs)                             # [N, T]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    pg_per_token = -torch.min(unclipped, clipped)                          # [N, T]
    if is_weights is not None:
        pg_per_token = pg_per_token * is_weights.detach()
    per_token = pg_per_token
    kl = None
    if beta > 0 and ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs.detach())                        # [N, T]
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, aggregation, max_completion_length)

    with torch.no_grad():
        low = ((ratio < 1.0 - eps_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_frac_low": masked_mean(low, mask).item(),
            "clip_frac_high": masked_mean(high, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": (ratio * mask).max().item() if mask.any() else 0.0,
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "pg_loss": aggregate(pg_per_token, mask, aggregation, max_completion_length).item(),
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    return loss, metrics
