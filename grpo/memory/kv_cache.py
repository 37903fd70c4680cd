"""The KV cache's bytes per token and what one step's rollouts need of it.

    bytes per token  = 2 (K and V) x layers x KV heads per GPU x head_dim x bytes per value
    KV heads per GPU = max(1, KV heads / tp)      (vLLM replicates KV heads when tp exceeds them)
    sequences        = tp x prompts per rank x k  (a tensor-parallel group generates its ranks' prompts together)
    tokens           = margin x sequences x (max_prompt_length + rollout_max_new_tokens),
                       at least one max_seq_length sequence and a few blocks (vLLM's start-up check)

Models whose cache is not one K and V per attention layer and token (MLA, hybrid linear-attention / state-space
stacks, per-layer head sizes) have no plain size: kv_bytes_per_token returns None for them. A vision-language model's
cache is its language model's (its text_config).
"""
from __future__ import annotations

import math

# config fields that mean the cache is not plain per-token K/V heads of one size
NON_STANDARD_CACHE_FIELDS = ("kv_lora_rank", "mamba_d_state", "ssm_state_size", "linear_key_head_dim",
                             "global_head_dim")
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
AUTO_MARGIN = 1.25  # vLLM's 16-token blocks and a little slack
FLOOR_SLACK_TOKENS = 256  # above one max_seq_length sequence: whole blocks, whatever the backend's block size


def kv_bytes_per_token(hf_config, tensor_parallel_size: int = 1, bytes_per_value: int = 2) -> int | None:
    """KV cache bytes one token takes on one GPU (module docstring), or None where the formula does not apply."""
    try:
        return _plain_kv_bytes_per_token(hf_config, tensor_parallel_size, bytes_per_value)
    except Exception:  # noqa: BLE001 -- a config refusing a field (Gemma-4's per-layer head_dim): not one size
        return None


def _plain_kv_bytes_per_token(hf_config, tensor_parallel_size: int, bytes_per_value: int) -> int | None:
    if hasattr(hf_config, "get_text_config"):  # a vision-language model's language model (a text model: itself)
        hf_config = hf_config.get_text_config()
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


def auto_kv_cache_bytes(bytes_per_token: int | None, sequences: int, tokens_per_sequence: int, max_seq_length: int,
                        margin: float = AUTO_MARGIN) -> int | None:
    """margin x sequences x tokens_per_sequence tokens, never below one max_seq_length sequence plus slack."""
    if bytes_per_token is None:
        return None
    tokens = max(math.ceil(margin * sequences * tokens_per_sequence), max_seq_length + FLOOR_SLACK_TOKENS)
    return tokens * bytes_per_token


def completions_per_prompt(config) -> int:
    """The completions of each prompt one engine generates: --k_samples, or where a sequence-parallel group's
    engines generate in shares (--sequence_parallel_rollout share, an engine of one GPU) the largest share."""
    sp = getattr(config, "sequence_parallel_size", 1)
    if sp > 1 and config.sequence_parallel_rollout == "share" and config.vllm_tp == 1:
        from grpo.runtime.sequence_parallel import split_count

        return split_count(config.k_samples, 0, sp)  # the first rank's share is the largest
    return config.k_samples
