"""A micro-batch's log-probs (and entropies) through the sequence-parallel path (--sequence_parallel_size N > 1):
each rank of a group runs 1/N of every row through DeepSpeed's Ulysses attention and the group gathers the
per-token results (grpo.runtime.sequence_parallel; the math: grpo.algorithm.sharded_logprobs)."""
from __future__ import annotations

import torch

from grpo.algorithm.sharded_logprobs import TokenScoring
from grpo.errors import ConfigError
from grpo.runtime.sequence_parallel import (ShardGroup, group_gradient_scale, group_of_this_rank,
                                            sharded_completion_scores)
from grpo.train.logprobs import decoder_and_head
from grpo.train.step_data import RolloutBatch


def sharded_score(model, batch: RolloutBatch, cfg, chunk_tokens: int, with_entropy: bool = False,
                  entropy_grad: bool = False, zero3: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, T] log-probs (and [n, T] entropies with `with_entropy`), 0 past each completion. Collective over the
    group: its ranks hold the same rows. `zero3`: the engine reduces gradients as ZeRO-3 does (group_gradient_scale)."""
    parts = decoder_and_head(model)
    if parts is None or batch.images:
        raise ConfigError("--sequence_parallel_size: the sharded forward needs a text model whose logits are its "
                          "output layer applied to the last hidden state (no vision, no logit soft-capping); use 1")
    decoder, head = parts
    group, sp_rank = group_of_this_rank()
    sp = cfg.sequence_parallel_size
    shards = ShardGroup(group, sp_rank, sp, grad_scale=group_gradient_scale(sp, 3 if zero3 else 0))
    scoring = TokenScoring(cfg.temperature, chunk_tokens, with_entropy=with_entropy, entropy_grad=entropy_grad)
    return sharded_completion_scores(decoder, head, batch.input_ids, batch.attention_mask, batch.completion_width,
                                     shards, scoring)
