"""The math of sequence-parallel scoring (--sequence_parallel_size N > 1) as pure tensor functions: cutting one
sequence into N shards, a shard's per-token log-probs (and entropies) from its hidden states, and the completion
tokens' scores picked out of a whole sequence's. The process group, the forward through the model and the gather of
the shards are grpo.runtime.sequence_parallel's.

One sequence of L real tokens (no padding inside):

    S = ceil(L / N) * N                          padded on the right
    label_t = token_{t+1}  (t < L - 1), IGNORE   shifted over the WHOLE sequence, then cut: the token after a
                                                 shard's last one lives on the next rank
    shard r = positions [r S/N, (r+1) S/N)       with their global position ids

A row of a RolloutBatch is [P + T]: the prompt left-padded, the completion right-padded. Its completion token j sits
at position p + j (p: the prompt's real tokens), so it is scored by position p + j - 1 of the sequence's [L - 1]
log-probs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo.algorithm.logprobs import hidden_token_logprobs, token_entropy, token_logprobs

IGNORE = -100


@dataclass
class SequenceShard:
    input_ids: torch.Tensor      # [1, S/N] this rank's slice of the (padded) sequence
    position_ids: torch.Tensor   # [1, S/N] its global positions
    shift_labels: torch.Tensor   # [1, S/N] the token each position predicts (IGNORE past the end)
    length: int                  # L, the real tokens of the sequence
    padded: int                  # S, L padded to a multiple of N


@dataclass(frozen=True)
class TokenScoring:
    """How a shard's tokens are scored: softmax(logits / temperature), from hidden states in chunks of
    `chunk_tokens` (0: the shard's whole [S/N, V] logits at once, as under ZeRO-3, whose gathered output layer cannot
    be recomputed in a chunk's checkpoint); entropies too with `with_entropy`, with gradient when `entropy_grad`."""
    temperature: float = 1.0
    chunk_tokens: int = 1024
    with_entropy: bool = False
    entropy_grad: bool = False


def shard_sequence(token_ids: torch.Tensor, sp_rank: int, sp_size: int, pad_id: int = 0) -> SequenceShard:
    """Rank `sp_rank`'s slice of one sequence [L] (no padding inside): labels shifted over the whole sequence first,
    then padded on the right to S = ceil(L / N) x N and cut into N slices of S / N."""
    length = int(token_ids.numel())
    padded = -(-length // sp_size) * sp_size
    ids = torch.full((padded,), pad_id, dtype=token_ids.dtype, device=token_ids.device)
    ids[:length] = token_ids
    labels = torch.full((padded,), IGNORE, dtype=token_ids.dtype, device=token_ids.device)
    labels[:length - 1] = token_ids[1:]                       # position t predicts token t+1
    positions = torch.arange(padded, device=token_ids.device)
    width = padded // sp_size
    cut = slice(sp_rank * width, (sp_rank + 1) * width)
    return SequenceShard(ids[cut].unsqueeze(0), positions[cut].unsqueeze(0), labels[cut].unsqueeze(0),
                         length, padded)


def shard_token_scores(hidden: torch.Tensor, head, labels: torch.Tensor,
                       scoring: TokenScoring) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A shard's log p(label_t | tokens <= t)  # [S/N], from its hidden states [S/N, H] and the output layer `head`;
    0 where the label is IGNORE. With `scoring.with_entropy` also H_t = -sum_v p_v log p_v  # [S/N] in fp32, 0 there
    too (detached unless `scoring.entropy_grad`), else None."""
    valid = labels != IGNORE
    # ignored positions score token 0 and are zeroed (every rank of the group runs the same chunk count)
    if scoring.chunk_tokens > 0:
        part, part_entropy = hidden_token_logprobs(hidden, head, labels.clamp(min=0), scoring.temperature,
                                                   chunk_tokens=scoring.chunk_tokens,
                                                   with_entropy=scoring.with_entropy,
                                                   entropy_grad=scoring.entropy_grad)
    else:  # ZeRO-3 (see update.score): the shard's own [S/N, V] logits, the head called once per rank
        logits = head(hidden).unsqueeze(0)
        part = token_logprobs(logits, labels.clamp(min=0).unsqueeze(0), scoring.temperature)[0]
        part_entropy = token_entropy(logits if scoring.entropy_grad else logits.detach(),
                                     temperature=scoring.temperature,
                                     with_grad=scoring.entropy_grad)[0] if scoring.with_entropy else None
    keep = valid.to(part.dtype)
    if not scoring.with_entropy:
        return part * keep, None
    entropy = part_entropy.float() * keep.float()
    return part * keep, (entropy if scoring.entropy_grad else entropy.detach())


def completion_scores(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
                      score_sequence: Callable, with_entropy: bool = False
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The completion tokens' scores of rows [n, P+T] (prompts left-padded, completions right-padded) -> [n, T]
    log-probs (and [n, T] entropies with `with_entropy`), 0 past each completion. `score_sequence(real_ids)` scores
    one row's real tokens [L] -> [L - 1] (a pair of them with `with_entropy`); a row without completion tokens is
    not scored."""
    rows, entropy_rows = [], []
    for ids, mask in zip(input_ids, attention_mask):
        real = mask.bool()
        prompt_len = int(real[:-completion_width].sum())
        completion_len = int(real[-completion_width:].sum())
        out = torch.zeros(completion_width, device=input_ids.device)
        out_entropy = torch.zeros(completion_width, device=input_ids.device)
        if completion_len:
            scored = score_sequence(ids[real])
            per_position, per_entropy = scored if with_entropy else (scored, None)            # [L - 1]
            # completion token j sits at position prompt_len + j, predicted by position prompt_len + j - 1
            taken = slice(prompt_len - 1, prompt_len - 1 + completion_len)
            tail = torch.zeros(completion_width - completion_len, device=input_ids.device)
            out = torch.cat([per_position[taken].float(), tail])
            if with_entropy:
                out_entropy = torch.cat([per_entropy[taken].float(), tail])
        rows.append(out)
        entropy_rows.append(out_entropy)
    return torch.stack(rows), (torch.stack(entropy_rows) if with_entropy else None)
