"""How large a colocated vLLM engine's KV cache should be.

vLLM's default gives the KV cache whatever `gpu_memory_utilization` leaves after the weights: ~20 GiB on an 80 GiB
GPU at the colocated share of 0.3, for a step that needs a few. A colocated engine frees and re-maps that memory
at every sleep and wake, and the time those take grows with its size (on one H100, a 0.68B model, 16 x 8 x 256
tokens: wake + sleep 0.075 s at 21 GiB, 0.025 s at 3.5 GiB). `--vllm_kv_cache_gib auto` sizes it to one step's
rollouts instead:

    bytes per token = 2 (K and V) x layers x KV heads per GPU x head_dim x bytes per value
    KV heads per GPU = max(1, KV heads / tp)       (vLLM replicates KV heads when tp exceeds them)
    sequences       = tp x prompts per rank x k    (a tensor-parallel group generates its ranks' prompts together)
    KV cache bytes  = margin x sequences x max_seq_length x bytes per token,  at least one max_seq_length sequence

max_seq_length bounds every prompt + completion, so the step's rollouts fit at once; larger batches (an eval over
more prompts) run in waves. Models whose cache is not one K and V per attention layer and token (MLA, hybrid
linear-attention / state-space stacks, vision-language models whose engine also reserves image memory) keep the
memory share: auto_kv_cache_bytes returns None for them.
"""
from __future__ import annotations

# config fields that mean the cache is not plain per-token K/V heads
NON_STANDARD_CACHE_FIELDS = ("kv_lora_rank", "mamba_d_state", "ssm_state_size", "linear_key_head_dim", "vision_config")
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
AUTO_MARGIN = 1.25  # vLLM's 16-token blocks and a little slack


def kv_bytes_per_token(hf_config, tensor_parallel_size: int = 1, bytes_per_value: int = 2) -> int | None:
    """KV cache bytes one token takes on one GPU (module docstring), or None where the formula does not apply."""
    if any(getattr(hf_config, name, None) is not None for name in NON_STANDARD_CACHE_FIELDS):
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and not set(layer_types) <= ATTENTION_LAYER_TYPES:
        return None
    layers = getattr(hf_config, "num_hidden_layers", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    hidden = getattr(hf_config, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * bytes_per_value


def auto_kv_cache_bytes(bytes_per_token: int | None, sequences: int, max_seq_length: int,
                        margin: float = AUTO_MARGIN) -> int | None:
    """margin x sequences x max_seq_length tokens, never below one whole sequence (vLLM's start-up check)."""
    if bytes_per_token is None:
        return None
    tokens = max(int(margin * sequences * max_seq_length), max_seq_length)
    return tokens * bytes_per_token
