"""Rewards into advantages: group-normalised advantages, the reward spread, and KL folded into the reward.

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from grpo.algorithm.registry import ADVANTAGE_SCALES


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
