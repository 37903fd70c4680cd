"""Rollout tensors: prompts left-padded to a common width P, completions right-padded to width T.

    input_ids        # [N, P+T]  prompt | completion, N = prompts x k_samples
    attention_mask   # [N, P+T]
    completion_mask  # [N, T]    1 on completion tokens that enter the loss (a multi-turn episode's environment
                                 tokens are 0: they are not the policy's actions)
    prompt_index     # [N]      which prompt of the step each row completes
    routed_experts   # [N, P+T, layers, k]  int, the experts the engine routed each token to (a mixture of experts
                                 under --routing_replay), -1 where nothing was routed (padding, each row's last token)
    staleness        # [N, T]    long, versions behind the trained policy that sampled each completion token
                                 (streamed rollouts: Completion.versions), 0 on padding, -1 on a row without
                                 versions; None when no row has them
    images           # per prompt: its processed images (vision-language models) or None; shared by its k rows
Every completion starts at column P, so one forward with `logits_to_keep=T+1` yields exactly the logits
that predict the completion tokens, and the prompt never enters the (large) logits tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from grpo.rollout.engine import Completion


@dataclass
class RolloutBatch:
    # each field's columns, for cutting micro-batches: "sequence" [N, P+T], "completion" [N, T], "row" [N],
    # "shared" (not cut by rows)
    input_ids: torch.Tensor = field(metadata={"columns": "sequence"})          # [N, P+T] long
    attention_mask: torch.Tensor = field(metadata={"columns": "sequence"})     # [N, P+T] long
    completion_ids: torch.Tensor = field(metadata={"columns": "completion"})   # [N, T] long
    completion_mask: torch.Tensor = field(metadata={"columns": "completion"})  # [N, T] float
    # [N, T] float, from the rollout engine; None when not asked for
    rollout_logprobs: Optional[torch.Tensor] = field(metadata={"columns": "completion"})
    truncated: torch.Tensor = field(metadata={"columns": "row"})               # [N] bool, hit the length limit
    prompt_index: Optional[torch.Tensor] = field(default=None, metadata={"columns": "row"})  # [N] long
    # [prompts] of grpo.model.vision.PromptImages or None, not sliced with the rows
    images: Optional[list] = field(default=None, metadata={"columns": "shared"})
    # [N, P+T, layers, k] int, the engine's routing of each token (--routing_replay); None without
    routed_experts: Optional[torch.Tensor] = field(default=None, metadata={"columns": "sequence"})
    # [N, T] long, versions behind of each completion token (streamed rollouts); None without versions
    staleness: Optional[torch.Tensor] = field(default=None, metadata={"columns": "completion"})

    @property
    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids without padding (the ids the rollout engine returned)."""
        lengths = self.attention_mask[:, -self.completion_width:].sum(1).tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]

    @property
    def completion_width(self) -> int:
        return self.completion_ids.shape[1]

    def rows(self, start: int, end: int) -> "RolloutBatch":
        return RolloutBatch(**{f.name: _apply(getattr(self, f.name), lambda t: t[start:end]) for f in fields(self)})

    def to(self, device) -> "RolloutBatch":
        return RolloutBatch(**{f.name: _apply(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)})

    @property
    def images_token_id(self) -> Optional[int]:
        return next((p.image_token_id for p in self.images or [] if p is not None), None)

    def image_inputs(self, device=None) -> dict:
        """pixel_values / image_grid_thw of these rows' prompts ({} for text prompts)."""
        if not self.images or self.prompt_index is None:
            return {}
        from grpo.model.vision import model_image_inputs

        return model_image_inputs(self.images, self.prompt_index.tolist(), device)


def _apply(value, fn):
    return fn(value) if isinstance(value, torch.Tensor) else value


def build_rollout_batch(prompt_ids: list[list[int]], completions: list[Completion], pad_id: int,
                        mask_truncated: bool = False, images: Optional[list] = None,
                        version: Optional[int] = None) -> RolloutBatch:
    """Pad prompts (left) and completions (right) into one batch; completion i belongs to its prompt_index.
    `version`: the policy version the step trains (its optimizer steps so far), for each token's staleness where
    every completion carries its tokens' versions."""
    prompt_width = max(len(prompt_ids[c.prompt_index]) for c in completions)
    comp_width = max(1, max(len(c.token_ids) for c in completions))
    n = len(completions)
    input_ids = torch.full((n, prompt_width + comp_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, prompt_width + comp_width), dtype=torch.long)
    comp_ids = torch.full((n, comp_width), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((n, comp_width), dtype=torch.float32)
    # the engine's log-probs, when it returned them for every token (see SamplingSettings.logprobs)
    with_logprobs = all(len(c.logprobs) == len(c.token_ids) for c in completions)
    rollout_lp = torch.zeros((n, comp_width), dtype=torch.float32) if with_logprobs else None
    versioned = [version is not None and c.versions is not None and len(c.versions) == len(c.token_ids)
                 for c in completions]
    staleness = torch.zeros((n, comp_width), dtype=torch.long) if any(versioned) else None
    truncated = torch.zeros(n, dtype=torch.bool)
    for i, c in enumerate(completions):
        p = prompt_ids[c.prompt_index]
        input_ids[i, prompt_width - len(p):prompt_width] = torch.tensor(p)
        attention[i, prompt_width - len(p):prompt_width] = 1
        t = len(c.token_ids)
        if t:
            input_ids[i, prompt_width:prompt_width + t] = torch.tensor(c.token_ids)
            attention[i, prompt_width:prompt_width + t] = 1
            comp_ids[i, :t] = torch.tensor(c.token_ids)
            if rollout_lp is not None:
                rollout_lp[i, :t] = torch.tensor(c.logprobs, dtype=torch.float32)
            if staleness is not None:
                staleness[i, :t] = version - torch.tensor(c.versions, dtype=torch.long) if versioned[i] else -1
        truncated[i] = c.finish_reason == "length"
        if not (mask_truncated and truncated[i]):
            comp_mask[i, :t] = 1.0 if c.mask is None else _episode_mask(c)
    prompt_index = torch.tensor([c.prompt_index for c in completions], dtype=torch.long)
    has_images = images is not None and any(p is not None for p in images)
    routed = routing_columns(completions, [len(prompt_ids[c.prompt_index]) for c in completions], prompt_width,
                             comp_width)
    return RolloutBatch(input_ids, attention, comp_ids, comp_mask, rollout_lp, truncated, prompt_index,
                        images if has_images else None, routed, staleness)


def routing_columns(completions: list[Completion], prompt_lengths: list[int], prompt_width: int,
                    completion_width: int) -> Optional[torch.Tensor]:
    """The completions' routing (each [prompt + completion - 1, layers, k]) in the batch's columns: a row's prompt
    ends at column P, its completion starts there  # [N, P+T, layers, k], -1 elsewhere; None when no completion
    carries routing."""
    carried = [c.routed_experts is not None for c in completions]
    if not any(carried):
        return None
    if not all(carried):
        raise ValueError(f"{carried.count(False)} of {len(completions)} completions came without the routing of "
                         "their tokens: routing replay needs every one's")
    from grpo.model.routing_replay import NOT_RECORDED, ROUTING_DTYPE

    layers, top_k = completions[0].routed_experts.shape[1:]
    routed = torch.full((len(completions), prompt_width + completion_width, layers, top_k), NOT_RECORDED,
                        dtype=ROUTING_DTYPE)
    for i, (c, prompt) in enumerate(zip(completions, prompt_lengths)):
        tokens = c.routed_experts[:prompt + len(c.token_ids)]
        start = prompt_width - prompt
        routed[i, start:start + len(tokens)] = tokens.to(ROUTING_DTYPE)
    return routed


def _episode_mask(completion: Completion) -> torch.Tensor:
    if len(completion.mask) != len(completion.token_ids):
        raise ValueError(f"a completion's mask has {len(completion.mask)} entries for {len(completion.token_ids)} "
                         "tokens")
    return torch.tensor(completion.mask, dtype=torch.float32)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded prompt sees the same positions as an unpadded one."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class StepData:
    """One optimizer step's data, from the rollout to the update (all tensors step-wide on this rank).

        batch            RolloutBatch of the step's N completions
        micro_batches    the rows grouped for the model (micro_batches.py); every rank runs as many
        advantages       # [N]     group-relative, one per completion
        rewards          # [N]     what the advantages came from
        normaliser       D of the step's loss aggregate over every rank (algorithm.aggregation_normaliser)
        ref_logprobs     # [N, T]  reference policy (KL term), None without one
        old_logprobs     # [N, T]  the ratio's old log-probs: given, or the first update's own kept for the later
                                   updates of --num_iterations (keep_for_later_updates)
        sampled_logprobs # [N, T]  the old policy without dropout (the engine's side of the mismatch and IS weights),
                                   kept likewise when dropout makes it differ from old_logprobs
        stale            the rollouts came from an older policy (--async_rollout): their gap to the trainer is logged
                         as rollout/offpolicy_logprob_diff rather than as the engine's mismatch
    """
    batch: RolloutBatch
    micro_batches: list  # [MicroBatch]
    advantages: torch.Tensor
    rewards: Optional[torch.Tensor] = None  # [N] what the advantages came from (KL-penalized with --kl_in_reward)
    normaliser: float = 1.0
    ref_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    sampled_logprobs: Optional[torch.Tensor] = None
    stale: bool = False
    fill_old: bool = False      # the next update writes old_logprobs (then reads them)
    fill_sampled: bool = False  # ... and sampled_logprobs

    @property
    def mismatch_key(self) -> str:
        return "rollout/offpolicy_logprob_diff" if self.stale else "rollout/logprob_diff"

    def keep_for_later_updates(self, device, keep_sampled: bool) -> None:
        """Room for what the first update computes and the later ones reuse."""
        self.old_logprobs = torch.zeros(self.batch.completion_ids.shape, device=device)
        self.fill_old = True
        if keep_sampled:
            self.sampled_logprobs = torch.zeros_like(self.old_logprobs)
            self.fill_sampled = True
