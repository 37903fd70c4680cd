"""The attention implementation a model is loaded with, where transformers' default would compute another model.

Gemma 2 soft-caps its attention logits, s = cap tanh(q.k / cap), before the softmax (`attn_logit_softcapping`, 50 at
9B). torch's scaled-dot-product kernels (SDPA) take no soft-cap: transformers 5.17 loads Gemma 2 with SDPA by default
and leaves the cap out without a word (a tiny Gemma 2 with a cap of 2: log-probs up to 0.68 nats off its eager ones),
while vLLM applies it, so the trainer scored another model than the engine sampled from (Gemma-2-9B: 4.1 nats
between them, other models 0.08-0.09); transformers 5.24 loads it eagerly and refuses SDPA for it. transformers'
eager path applies the cap but holds every layer's scores, heads x row x row per row of a micro-batch (6.2 GiB for
one 4,352-token row of Gemma-2-9B in its backward). (flex_attention applies it too, but has no backward on CPU, and on
a GPU compiles a variant per mask, padding and grad mode: a GRPO step's mix passes torch's recompile limit of 8, past
which it runs unfused, materializing the scores.) So such a model is loaded with `soft_capped_attention` below: the eager
computation, a block of QUERY_BLOCK queries at a time, each block's scores recomputed in the backward (checkpointed):
the same numbers, scores of one block alive at once. The memory plan counts them (grpo.memory.activations).
"""
from __future__ import annotations

from typing import Optional

import torch

ATTENTION_SOFT_CAP = "attn_logit_softcapping"
SOFT_CAPPED = "grpo_soft_capped"  # the name soft_capped_attention is registered under with transformers
# queries a block: its scores (B x heads x QUERY_BLOCK x keys) are what one layer holds at once, forward or backward
QUERY_BLOCK = 512


def attention_soft_cap(config) -> Optional[float]:
    """The model's attention-logit soft-cap (a vision-language model's text config's), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, ATTENTION_SOFT_CAP, None) or getattr(config, ATTENTION_SOFT_CAP, None)


def attention_implementation(config) -> Optional[str]:
    """SOFT_CAPPED (registered with transformers here) for a model whose attention logits are soft-capped; None
    (transformers' default) otherwise."""
    if not attention_soft_cap(config):
        return None
    register_soft_capped_attention()
    return SOFT_CAPPED


def why(config) -> str:
    """The log line for a model loaded with `attention_implementation(config)`."""
    return (f"attention: eager, in blocks of {QUERY_BLOCK} queries ({ATTENTION_SOFT_CAP} "
            f"{attention_soft_cap(config):g}: torch's SDPA kernels leave the soft-cap out, which vLLM applies; the "
            "eager computation keeps it, one block's scores at a time)")


def register_soft_capped_attention() -> None:
    """Make SOFT_CAPPED a name transformers loads with: the attention function and eager's additive mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(SOFT_CAPPED, soft_capped_attention)
    AttentionMaskInterface.register(SOFT_CAPPED, eager_mask)


def soft_capped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, softcap: Optional[float] = None, **kwargs):
    """transformers' eager attention (Gemma 2's: scores q k^T x scaling, soft-capped, masked, softmax in fp32), a
    block of QUERY_BLOCK queries at a time; with gradients each block is checkpointed, so its backward recomputes
    the block's scores rather than keeping every block's. query [B, Hq, Q, D], key / value [B, Hkv, K, D] (Hq a
    multiple of Hkv: grouped queries), the mask additive [B, 1, Q, K] or None. Returns ([B, Q, Hq, D], None)."""
    from torch.utils.checkpoint import checkpoint

    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    dropout = dropout if module.training else 0.0

    # key and value enter each block as the checkpoint's inputs, not through the closure: what a checkpoint keeps of
    # its function (the closure) escapes the layers' own checkpointing, so every layer's repeated key and value
    # (2 q a bytes a token) stayed alive from its forward to its backward (Gemma-2-9B: 0.66 MiB a token, 5.6 GiB
    # over a micro-batch of two 4,352-token rows, measured on an H200 as training 6.2 GiB above its plan)
    def block(q, key, value, mask):
        scores = torch.matmul(q, key.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0)
        return torch.matmul(weights, value)

    outputs = []
    for start in range(0, query.shape[2], QUERY_BLOCK):
        q = query[:, :, start:start + QUERY_BLOCK]
        mask = attention_mask
        if mask is not None:  # (a mask broadcast over the queries, [B, 1, 1, K], serves every block as it is)
            mask = mask[:, :, start:start + QUERY_BLOCK] if mask.shape[2] > 1 else mask
            mask = mask[..., : key.shape[2]]
        if torch.is_grad_enabled() and (q.requires_grad or key.requires_grad or value.requires_grad):
            outputs.append(checkpoint(block, q, key, value, mask, use_reentrant=False))
        else:
            outputs.append(block(q, key, value, mask))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def packing_refusal(config) -> Optional[str]:
    """Why --padding_free cannot pack this model's micro-batches, or None: a packed micro-batch is one row of all its
    tokens, whose additive masks grow with the square of them (16,384 tokens: 0.5 GiB each in bf16) and each of whose
    query blocks holds scores against all of them, where the plan counts rows of one sequence."""
    if attention_implementation(config) != SOFT_CAPPED:
        return None
    return (f"--padding_free packs a micro-batch into one row, and this model loads with eager attention in blocks "
            f"of queries (its {ATTENTION_SOFT_CAP} {attention_soft_cap(config):g}, which torch's SDPA kernels leave "
            "out), whose masks grow with the square of a row's tokens: leave --padding_free off for it (rows of one "
            "sequence each, as the memory plan counts them)")


def sequence_parallel_refusal(config, sp_size: int) -> Optional[str]:
    """Why --sequence_parallel_size cannot shard this model's attention, or None: DeepSpeed's Ulysses attention wraps
    SDPA or flash attention (grpo.runtime.sequence_parallel), and a soft-capped model loads with grpo's eager
    attention, since SDPA would drop the soft-cap."""
    if sp_size <= 1 or attention_implementation(config) != SOFT_CAPPED:
        return None
    return (f"--sequence_parallel_size {sp_size}: this model soft-caps its attention logits ({ATTENTION_SOFT_CAP} "
            f"{attention_soft_cap(config):g}) and loads with grpo's eager attention in blocks of queries, which "
            "DeepSpeed's Ulysses attention does not wrap (it wraps SDPA, which would drop the soft-cap, or flash "
            "attention); use --sequence_parallel_size 1 (long rows fit: one block of queries' scores at a time)")
