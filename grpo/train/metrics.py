"""What a step logs: rewards, advantages, lengths and timings, over every rank (an evaluation's: evaluation.py)."""
from __future__ import annotations

import math

import torch

from grpo.runtime import distributed as dist_utils
from grpo.algorithm import reward_std
from grpo.rollout.dynamic_sampling import ZERO_STD


def step_metrics(batch, drawn, rewards: torch.Tensor, advantages: torch.Tensor, train_metrics: dict, times: dict,
                 k_samples: int, kl_in_reward: bool, copies: int = 1) -> dict:
    """This rank's metrics of the step (all ranks call it: reward/std is reduced over them). `copies`: how many
    ranks hold the same rows (--sequence_parallel_size); the means over ranks count each group's copies alike.

    Reward metrics are over every completion drawn this step (`drawn`: all rounds of dynamic sampling), before any KL
    penalty; the rest over the rows trained on (`rewards`: what the advantages came from)."""
    raw = drawn.rewards                                                          # [rounds x N]
    grouped = raw.view(-1, k_samples)
    lengths = batch.attention_mask[:, -batch.completion_width:].sum(1).float()  # [N] completion tokens
    reward_metrics = {f"rewards/{name}": value for name, value in drawn.result.means().items()}
    if kl_in_reward:
        reward_metrics["reward/kl_penalized_mean"] = rewards.mean().item()
    return {
        "reward/mean": raw.mean().item(),
        "reward/std": step_std(raw, copies),  # over every rank's completions (the same on each rank)
        "reward/zero_std_group_frac": (grouped.std(dim=1) < ZERO_STD).float().mean().item(),
        "advantage/abs_mean": advantages.abs().mean().item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/length_max": lengths.max().item(),
        "completion/truncated_frac": batch.truncated.float().mean().item(),
        **reward_metrics, **train_metrics,
        **{f"time/{k_}": v for k_, v in times.items() if not k_.startswith("_")},
        "throughput/rollout_tokens_per_s": times["_rollout_tokens"] / max(times["rollout"], 1e-9),
    }


def step_std(values: torch.Tensor, copies: int = 1) -> float:
    """The std of every rank's values together (all ranks call it): two reductions, the mean, then the squared
    deviations about it, which keeps the std exact for values far from 0. `copies`: how many ranks hold each value
    (the N ranks of a sequence-parallel group hold the same rows), counted once."""
    r = values.double()
    total, count = (value / copies for value in dist_utils.all_sum([r.sum().item(), float(r.numel())]))
    squared = dist_utils.all_sum([((r - total / max(count, 1.0)) ** 2).sum().item()])[0] / copies
    return reward_std(squared, count)


def mean_over_ranks(local: dict) -> dict:
    """Average each metric over the ranks that have it (max for *_max keys)."""
    parts = dist_utils.gather_objects(local)
    out = {}
    for key in sorted({k for p in parts for k in p}):
        values = [p[key] for p in parts if key in p and p[key] is not None and not math.isnan(p[key])]
        if values:
            out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return out
