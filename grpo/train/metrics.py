"""What a step logs: rewards, advantages, lengths and timings, over every rank (an evaluation's: evaluation.py)."""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch

from grpo.runtime import distributed as dist_utils
from grpo.algorithm import reward_std
from grpo.rollout.dynamic_sampling import ZERO_STD

logger = logging.getLogger("grpo")


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


class ZeroSpreadWatch:
    """Says when a step had nothing to learn from: every group's rewards equal (reward/zero_std_group_frac 1 over
    every rank), so every advantage is 0 and the update moves nothing but the KL and entropy terms. Said at the first
    such step, again when they run 10 and 100 steps in a row, with the usual causes."""

    REPEAT_AT = (10, 100)

    def __init__(self):
        self.streak = 0
        self.said = False

    def check(self, step: int, metrics: dict) -> Optional[str]:
        """The warning for this step's metrics (also logged), or None."""
        if metrics.get("reward/zero_std_group_frac", 0.0) < 1.0 - 1e-9:
            self.streak = 0
            return None
        self.streak += 1
        if self.said and self.streak not in self.REPEAT_AT:
            return None
        self.said = True
        text = zero_spread_message(step, metrics, self.streak)
        logger.warning(text)
        return text


def zero_spread_message(step: int, metrics: dict, streak: int = 1) -> str:
    """Why a step whose groups all scored alike taught nothing, and what usually causes it."""
    mean, truncated = metrics.get("reward/mean", 0.0), metrics.get("completion/truncated_frac", 0.0)
    where = f"step {step}" if streak == 1 else f"steps {step - streak + 1}-{step} ({streak} in a row)"
    if abs(mean) < 1e-12:
        what = "every completion scored 0"
        causes = [f"completions cut off before their answer ({truncated:.0%} reached --rollout_max_new_tokens: "
                  "raise it)" if truncated > 0 else "completions cut off before their answer (--rollout_max_new_tokens)",
                  "answers in a form the rewards do not read (compare completions/rank0.jsonl with the dataset's "
                  "answer_extractor and rewards)",
                  "a task beyond the model as it starts (an easier dataset, a larger model, or --warm_start_steps on "
                  "demonstrations)"]
    else:
        what = f"the completions of each prompt all scored alike (reward/mean {mean:.3g})"
        causes = ["a task the model already solves every time, or never (a harder or easier dataset)",
                  "samples too alike to differ (more --k_samples, a higher --temperature)",
                  "a reward that scores every completion the same"]
    return (f"{where}: {what}, so every group's rewards are equal and the step had nothing to learn from (advantages "
            f"0). Usual causes: {'; '.join(causes)}. --filter_zero_std_groups draws other prompts in place of such "
            f"groups")
