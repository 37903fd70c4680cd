"""The attention implementation a model is loaded with, where transformers' default would compute another model.

Gemma 2 soft-caps its attention logits, s = cap tanh(q.k / cap), before the softmax (`attn_logit_softcapping`, 50 at
9B). torch's scaled-dot-product kernels (SDPA) take no soft-cap: transformers 5.17 loads Gemma 2 with SDPA by default
and leaves the cap out without a word (a tiny Gemma 2 with a cap of 2: log-probs up to 0.68 nats off its eager ones),
while vLLM applies it, so the trainer scored another model than the engine sampled from (Gemma-2-9B: 4.1 nats
between them, other models 0.08-0.09); transformers 5.24 loads it eagerly and refuses SDPA for it. The eager path
applies the cap, on every version: such a model is loaded with it. (flex_attention applies it too, but has no
backward on CPU and compiles a kernel per shape on a GPU.) Eager attention materializes every layer's scores, heads x
row x row per row of a micro-batch; the memory plan counts them (grpo.memory.activations).
"""
from __future__ import annotations

from typing import Optional

ATTENTION_SOFT_CAP = "attn_logit_softcapping"
EAGER = "eager"


def attention_soft_cap(config) -> Optional[float]:
    """The model's attention-logit soft-cap (a vision-language model's text config's), or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, ATTENTION_SOFT_CAP, None) or getattr(config, ATTENTION_SOFT_CAP, None)


def attention_implementation(config) -> Optional[str]:
    """"eager" for a model whose attention logits are soft-capped; None (transformers' default) otherwise."""
    return EAGER if attention_soft_cap(config) else None


def why(config) -> str:
    """The log line for a model loaded with `attention_implementation(config)`."""
    return (f"attention: eager ({ATTENTION_SOFT_CAP} {attention_soft_cap(config):g}: torch's SDPA kernels leave the "
            "soft-cap out, which vLLM applies; eager attention keeps it, and holds each layer's attention scores)")


def packing_refusal(config) -> Optional[str]:
    """Why --padding_free cannot pack this model's micro-batches, or None: eager attention's scores grow with the
    square of a row, and a packed micro-batch is one row of all its tokens (16,384 tokens, 16 heads: 4 GiB a layer
    in bf16), where the plan counts rows of one sequence."""
    if attention_implementation(config) != EAGER:
        return None
    return (f"--padding_free packs a micro-batch into one row, and this model loads with eager attention (its "
            f"{ATTENTION_SOFT_CAP} {attention_soft_cap(config):g}, which torch's SDPA kernels leave out), whose "
            "scores grow with the square of a row's tokens: leave --padding_free off for it (rows of one sequence "
            "each, as the memory plan counts them)")
