"""Ulysses sequence parallelism (DeepSpeed ALST) for the training forward / backward: groups, the sharded forward,
gathering. The math it runs (cutting a sequence, a shard's log-probs, the completions' scores) is
grpo.algorithm.sharded_logprobs'.

The attention itself is DeepSpeed's (`UlyssesSPAttentionHF.register_with_transformers`, which wraps the model's sdpa /
flash_attention_2 entry and returns the mpu that `deepspeed.initialize(mpu=...)` takes). This module only does what
the wrapped model needs around it:

- groups: ranks [g*N, (g+1)*N) form sequence-parallel group g and train on the SAME samples, so data sharding and
  rollouts go by data-parallel rank  rank // N  over  world / N  data-parallel ranks.
- sharding: one sequence (a row's real tokens, no padding) padded on the right to a multiple of N, its labels shifted
  BEFORE sharding (the token after a shard's last token lives on the next rank), cut into N equal slices; the
  position ids are the global ones (DeepSpeed all-gathers them inside attention for the causal mask).
- gathering: every rank computes its shard's per-token log-probs from hidden states in chunks
  (algorithm.sharded_logprobs.shard_token_scores, never a full [T, V] logits tensor), then the group all-gathers them
  differentiably, so every rank holds the row's full log-probs and the existing loss code runs unchanged.

Gradient scale. Every rank of a group then computes the same loss L_g. The backward of all_gather sums the
gradients of all N ranks into each shard, i.e. N x dL_g/d(shard); `gather_shards` scales that back by 1/N, so
the group's ranks together hold exactly dL_g/dtheta. DeepSpeed with the SP mpu reduces gradients over all ranks and
divides by world / N (the data-parallel size): the mean over data-parallel ranks, as without SP. Except ZeRO-3 with
reduce_scatter (its default): DeepSpeed 0.19.8's stage3 `__avg_scatter_grads` reduces through
`reduce_scatter_coalesced`, which divides by the whole partition group (world), not by world / N; there each rank
keeps its shard's whole gradient instead (`group_gradient_scale`).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from grpo.algorithm.sharded_logprobs import TokenScoring, completion_scores, shard_sequence, shard_token_scores

logger = logging.getLogger("grpo")
SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2")
# the attention functions register_ulysses replaced by DeepSpeed's wrapper, by name: generating with the training model
# (the HF rollout engine) needs them back, one whole sequence per rank (unsharded_attention)
_UNSHARDED: dict = {}


def data_parallel_rank(rank: int, sp_size: int) -> int:
    """The data-parallel rank of a global rank: the index of its sequence-parallel group."""
    return rank // sp_size


def data_parallel_world(world: int, sp_size: int) -> int:
    """How many data-parallel ranks (sequence-parallel groups) a world of `world` ranks has."""
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"sequence_parallel_size {sp_size} must divide the number of ranks {world}")
    return world // sp_size


def layout_line(world: int, sp_size: int) -> str:
    """The one line logged at start."""
    groups = data_parallel_world(world, sp_size)
    return (f"sequence parallel: {groups} group{'s' if groups != 1 else ''} of {sp_size} ranks; each rank holds "
            f"1/{sp_size} of every sequence")


def register_ulysses(model, sp_size: int, micro_batch_size: int = 1):
    """Route the model's attention through DeepSpeed's Ulysses all-to-all attention; returns the mpu for
    `deepspeed.initialize(mpu=...)` (None for sp_size 1). The process group must exist (init_distributed)."""
    if sp_size <= 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        from grpo.errors import ConfigError

        raise ConfigError(f"--sequence_parallel_size {sp_size}: the model's attention is '{attention}'; DeepSpeed's "
                          f"Ulysses attention wraps {' or '.join(SUPPORTED_ATTENTION)} (load the model with "
                          f"attn_implementation='sdpa', or install flash-attn)")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _UNSHARDED.setdefault(attention, ALL_ATTENTION_FUNCTIONS[attention])
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp_size,
        micro_batch_size=micro_batch_size, seq_length_is_variable=True)


def group_gradient_scale(sp_size: int, zero_stage: int) -> float:
    """What `gather_shards` multiplies the gradient by, so that DeepSpeed's reduction ends at the mean over
    data-parallel ranks (module note): 1/N where DeepSpeed divides by world / N, 1 under ZeRO-3, which divides by
    world (with reduce_scatter; setup.check_sequence_parallel_zero refuses ZeRO-3 without it)."""
    return 1.0 if zero_stage == 3 else 1.0 / sp_size


def gather_shards(part: torch.Tensor, group, sp_size: int, grad_scale: Optional[float] = None) -> torch.Tensor:
    """Concatenate the group's [S/N] shards into [S] on every rank, differentiably; the gradient each shard gets
    back is `grad_scale` (default 1/N) x the N ranks' summed gradients of the (identical) loss every rank computes,
    i.e. dL/d(shard) by default (see the module's note)."""
    import torch.distributed.nn.functional as dist_nn

    scale = 1.0 / sp_size if grad_scale is None else grad_scale
    parts = dist_nn.all_gather(part.contiguous(), group=group)
    full = torch.cat(parts, dim=0)                                         # [S]
    # value: full; gradient: full's x scale (all_gather's backward sums the N ranks' identical gradients)
    return full * scale + full.detach() * (1.0 - scale)


@dataclass(frozen=True)
class ShardGroup:
    """A sequence-parallel group as the sharded forward sees it: the process group, this rank's place in it, and the
    scale of the gradient each gather hands back to a shard (`grad_scale`: gather_shards')."""
    group: Any
    rank: int            # this rank's place in the group: it holds shard `rank` of every sequence
    size: int            # N
    grad_scale: Optional[float] = None

    def gather(self, part: torch.Tensor, length: int) -> torch.Tensor:
        """The group's shards [S/N] of one sequence, concatenated and cut to its first `length` positions, on every
        rank (gather_shards: collective over the group)."""
        return gather_shards(part, self.group, self.size, self.grad_scale)[:length]


def sharded_sequence_scores(decoder, head, token_ids: torch.Tensor, shards: ShardGroup, scoring: TokenScoring,
                            pad_id: int = 0):
    """log p(token t+1 | tokens <= t) for every position t of one sequence [L] -> [L - 1] (with
    `scoring.with_entropy`: and the entropies [L - 1]), computed with the sequence split over the group: each rank's
    decoder sees its S/N tokens (attention exchanges heads all-to-all), scores them (grpo.algorithm.sharded_logprobs)
    and the group gathers the shards. Collective over the group: every rank passes the same sequence."""
    shard = shard_sequence(token_ids, shards.rank, shards.size, pad_id)
    hidden = decoder(input_ids=shard.input_ids, position_ids=shard.position_ids,
                     use_cache=False).last_hidden_state[0]                               # [S/N, H]
    part, part_entropy = shard_token_scores(hidden, head, shard.shift_labels[0], scoring)
    full = shards.gather(part, shard.length - 1)                                         # [L - 1]
    if not scoring.with_entropy:
        return full
    entropy = shards.gather(part_entropy, shard.length - 1)
    return full, (entropy if scoring.entropy_grad else entropy.detach())


def sharded_completion_scores(decoder, head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              completion_width: int, shards: ShardGroup, scoring: TokenScoring,
                              pad_id: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The completion tokens' log-probs (and entropies) of a RolloutBatch's rows [n, P+T] -> [n, T], 0 past each
    completion (grpo.algorithm.sharded_logprobs.completion_scores): one row at a time through the sharded forward
    (DeepSpeed's Ulysses attention holds a fixed batch size of 1). Every rank of the group passes the same rows."""
    return completion_scores(input_ids, attention_mask, completion_width,
                             lambda ids: sharded_sequence_scores(decoder, head, ids, shards, scoring, pad_id),
                             scoring.with_entropy)


def sharded_completion_logprobs(decoder, head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                completion_width: int, group, sp_rank: int, sp_size: int, temperature: float = 1.0,
                                chunk_tokens: int = 1024, pad_id: int = 0,
                                grad_scale: Optional[float] = None) -> torch.Tensor:
    """sharded_completion_scores' log-probs alone  # [n, T], with the group and the scoring given value by value."""
    return sharded_completion_scores(decoder, head, input_ids, attention_mask, completion_width,
                                     ShardGroup(group, sp_rank, sp_size, grad_scale),
                                     TokenScoring(temperature, chunk_tokens), pad_id)[0]


def group_of_this_rank():
    """(group, rank in it) of the sequence-parallel group register_ulysses set up."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp.get_sequence_parallel_rank()


@contextmanager
def unsharded_attention():
    """Within it the model's attention is the one register_ulysses wrapped (each rank attends over the whole
    sequence it holds, no all-to-all): for generating with the training model on one rank of a group. A no-op when
    nothing was wrapped."""
    if not _UNSHARDED:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapped = {name: ALL_ATTENTION_FUNCTIONS[name] for name in _UNSHARDED}
    for name, original in _UNSHARDED.items():
        ALL_ATTENTION_FUNCTIONS[name] = original
    try:
        yield
    finally:
        for name, wrapper in wrapped.items():
            ALL_ATTENTION_FUNCTIONS[name] = wrapper


# ------------------------------------------------------------------------------------------- shared rollouts
def split_count(count: int, index: int, parts: int) -> int:
    """Part `index` of `count` items split over `parts`: count // parts each, the first count % parts one more
    (8 over 3: 3, 3, 2)."""
    return count // parts + (index < count % parts)


@dataclass
class RolloutGroup:
    """The ranks that share one rollout: a sequence-parallel group. Its ranks generate shares of it (`share_of`,
    `gather`), or its first rank all of it (`share` hands that to the others), so rewards, advantages and the update
    are computed alike on every rank of the group."""
    group: Any           # torch.distributed process group of the ranks [first, first + size)
    first: int           # the global rank that generates
    size: int

    @property
    def generates(self) -> bool:
        import torch.distributed as dist

        return dist.get_rank() == self.first

    @property
    def rank_in_group(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() - self.first

    def share_of(self, count: int) -> int:
        """This rank's part of `count` items split over the group (split_count)."""
        return split_count(count, self.rank_in_group, self.size)

    def share(self, value):
        """The first rank's `value` on every rank of the group (collective over the group; pickled)."""
        import torch.distributed as dist

        box = [value if self.generates else None]
        dist.broadcast_object_list(box, src=self.first, group=self.group)
        return box[0]

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank of the group (collective over the group; pickled)."""
        import torch.distributed as dist

        values = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values


def rollout_groups(sp_size: int) -> Optional[RolloutGroup]:
    """This rank's RolloutGroup (None for sp_size 1): the sequence-parallel group register_ulysses set up (ranks
    [g*N, (g+1)*N)), so the broadcast rides the process group the sharded attention already has."""
    if sp_size <= 1:
        return None
    import torch.distributed as dist

    group, sp_rank = group_of_this_rank()
    return RolloutGroup(group, dist.get_rank() - sp_rank, sp_size)
