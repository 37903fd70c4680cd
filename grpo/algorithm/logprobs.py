"""Token log-probabilities and entropies from logits or from hidden states, in chunks (no [N, T, V] tensor).

Shapes: N = completions (B prompts x group size G), T = completion tokens, V = vocabulary.
"""
from __future__ import annotations

from typing import Optional

import torch


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
