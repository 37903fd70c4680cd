"""Rollout rounds of one step, and DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2) over them.

A round draws the next prompts, samples k completions of each and scores them (`RolloutRound`). Without dynamic
sampling a step is one round. With it, a group whose k rewards are all equal has advantage 0 everywhere and
teaches nothing: such groups are set aside and more rounds are drawn until the step has its number of
informative groups, or `max_rounds` rounds were drawn. The step then trains on its first `target` informative
groups in draw order, topped up with set-aside uniform groups when there are too few (advantage 0: they add no
policy gradient, and every rank keeps the same number of rows, so its micro-batches stay in step with the others').
Every prompt drawn advances the data position, so a resumed run draws exactly what an uninterrupted one would.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from grpo.rewards import RewardResult

ZERO_STD = 1e-6  # a group whose reward std is below this counts as uniform (as reward/zero_std_group_frac)


def informative_groups(rewards: torch.Tensor, group_size: int, tol: float = ZERO_STD) -> list[int]:
    """Indices of the groups whose rewards are not all equal: std_g > tol. rewards [B*G], groups consecutive."""
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"need a flat [B*G] reward vector with G >= 2, got shape {tuple(rewards.shape)} and "
                         f"G = {group_size}")
    std = rewards.float().view(-1, group_size).std(dim=1)                          # [B]
    return [g for g, s in enumerate(std.tolist()) if s > tol]


def select_groups(informative: list[int], num_groups: int, target: int) -> list[int]:
    """The groups a step trains on, in draw order: the first `target` informative ones; when there are fewer,
    topped up with the earliest uniform groups up to `target` (or all groups when fewer were drawn)."""
    chosen = informative[:target]
    if len(chosen) < target:
        taken = set(chosen)
        fillers = [g for g in range(num_groups) if g not in taken][:target - len(chosen)]
        chosen = chosen + fillers
    return sorted(chosen)


@dataclass
class PendingRollouts:
    """Prompts whose completions were asked for and not yet received (server mode posts them ahead)."""
    prompts: list[dict]
    images: Optional[list]                 # per prompt, processed images (vision models), or None
    sampling: object                       # grpo.rollout.engine.SamplingSettings
    policy_step: int                       # optimizer steps behind the weights that generate them
    ticket: object = None                  # grpo.rollout.collect.RolloutTickets: what the engine was asked for
    seconds: dict = field(default_factory=dict)


@dataclass
class RolloutRound:
    """The prompts of one or more rounds with their k completions each (grouped by prompt) and their rewards."""
    prompts: list[dict]
    completions: list                      # grpo.rollout.engine.Completion, k per prompt
    texts: list[str]
    result: RewardResult                   # total and per-function rewards, one per completion
    images: Optional[list] = None          # per prompt, processed images (vision models) or None
    times: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # dynamic sampling's metrics

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor(self.result.total, dtype=torch.float32)  # [N]


def renumbered(completions: list, group_size: int) -> list:
    """The completions with prompt_index set to their group's position in `completions` (k per prompt, in order):
    a batch pairs each completion with prompt_ids[prompt_index], so rows moved between rounds must follow."""
    return [replace(c, prompt_index=i // group_size) for i, c in enumerate(completions)]


def concat_rounds(rounds: list[RolloutRound], group_size: int) -> RolloutRound:
    """All rounds as one, in draw order (completions renumbered to the joined prompts); times summed."""
    if len(rounds) == 1:
        return rounds[0]
    n = [len(r.texts) for r in rounds]
    names = list(dict.fromkeys(name for r in rounds for name in r.result.per_function))
    per_function = {name: [v for r, size in zip(rounds, n) for v in r.result.per_function.get(name, [None] * size)]
                    for name in names}
    images = None
    if any(r.images for r in rounds):
        images = [img for r in rounds for img in (r.images or [None] * len(r.prompts))]
    times: dict = {}
    for r in rounds:
        for key, value in r.times.items():
            times[key] = times.get(key, 0.0) + value
    return RolloutRound([p for r in rounds for p in r.prompts],
                        renumbered([c for r in rounds for c in r.completions], group_size),
                        [t for r in rounds for t in r.texts],
                        RewardResult([v for r in rounds for v in r.result.total], per_function), images, times)


def pick_groups(drawn: RolloutRound, groups: list[int], group_size: int) -> RolloutRound:
    """The chosen groups of `drawn` (prompts, their completions and rewards), in the given order; each completion
    points at its prompt's new position."""
    rows = [g * group_size + j for g in groups for j in range(group_size)]
    result = RewardResult([drawn.result.total[i] for i in rows],
                          {name: [values[i] for i in rows] for name, values in drawn.result.per_function.items()})
    completions = renumbered([drawn.completions[i] for i in rows], group_size)
    return RolloutRound([drawn.prompts[g] for g in groups], completions,
                        [drawn.texts[i] for i in rows], result,
                        [drawn.images[g] for g in groups] if drawn.images else None, dict(drawn.times))


def dynamic_rollouts(run_round: Callable[[], RolloutRound], group_size: int, target: int, max_rounds: int,
                     any_rank: Callable[[bool], bool] = bool) -> tuple[RolloutRound, RolloutRound]:
    """Draw rounds until `target` informative groups are in hand (on every rank: `any_rank` makes the decision
    collective, so ranks draw the same number of rounds) or `max_rounds` were drawn.

    Returns (kept, drawn): the step's groups (see select_groups), with metrics in kept.stats, and every completion
    drawn (for reward logging: the rewards the policy actually earned, not only those of the kept groups).
    """
    rounds: list[RolloutRound] = []
    informative: list[int] = []
    groups_drawn = 0
    while True:
        new = run_round()
        rounds.append(new)
        informative += [groups_drawn + g for g in informative_groups(new.rewards, group_size)]
        groups_drawn += len(new.prompts)
        if len(rounds) >= max_rounds or not any_rank(len(informative) < target):
            break
    drawn = concat_rounds(rounds, group_size)
    kept = pick_groups(drawn, select_groups(informative, groups_drawn, target), group_size)
    kept.stats = {"dynamic_sampling/rounds": float(len(rounds)),
                  "dynamic_sampling/groups_kept": float(min(len(informative), target)),
                  "dynamic_sampling/informative_groups": float(len(informative)),
                  "dynamic_sampling/prompts_drawn": float(groups_drawn)}
    return kept, drawn
