"""How large a colocated vLLM engine's KV cache should be.

vLLM's default gives the KV cache whatever `gpu_memory_utilization` leaves after the weights and its profiled
activations: ~20 GiB on an 80 GiB GPU at the colocated share of 0.3, for a step that needs a few. A colocated engine
frees and re-maps that memory at every sleep and wake, and the time those take grows with its size (on one H100, a
0.68B model, 16 x 8 x 256 tokens: wake + sleep 0.075 s at 21 GiB, 0.025 s at 3.5 GiB). `--vllm_kv_cache_gib auto`
sizes it to one step's rollouts instead, per GPU:

    bytes per token  = 2 (K and V) x layers x KV heads per GPU x head_dim x bytes per value
    KV heads per GPU = max(1, KV heads / tp)      (vLLM replicates KV heads when tp exceeds them)
    sequences        = tp x prompts per rank x k  (a tensor-parallel group generates its ranks' prompts together)
    tokens           = margin x sequences x (max_prompt_length + rollout_max_new_tokens),
                       at least one max_seq_length sequence and a few blocks (vLLM's start-up check)

so the step's rollouts fit at once; larger batches (an eval over more prompts) run in waves. auto never asks for more
than the share would have given: where the rollouts need more than half of what the share leaves after the weights
(the other half standing for vLLM's activations, which only its own profiling knows), the share sizes the cache as
before. Models whose cache is not one K and V per attention layer and token (MLA, hybrid linear-attention /
state-space stacks, per-layer head sizes, vision-language models whose engine also reserves image memory) keep the
share: kv_bytes_per_token returns None for them.
"""
from __future__ import annotations

import glob
import json
import math
import os

# config fields that mean the cache is not plain per-token K/V heads of one size
NON_STANDARD_CACHE_FIELDS = ("kv_lora_rank", "mamba_d_state", "ssm_state_size", "linear_key_head_dim",
                             "vision_config", "global_head_dim")
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
AUTO_MARGIN = 1.25  # vLLM's 16-token blocks and a little slack
FLOOR_SLACK_TOKENS = 256  # above one max_seq_length sequence: whole blocks, whatever the backend's block size


_UNREADABLE = object()


def _field(hf_config, name: str):
    # some configs raise on a field that differs per layer (transformers' Gemma-4 `head_dim`): not one size then
    try:
        return getattr(hf_config, name, None)
    except Exception:  # noqa: BLE001 -- any refusal means the formula does not apply
        return _UNREADABLE


def kv_bytes_per_token(hf_config, tensor_parallel_size: int = 1, bytes_per_value: int = 2) -> int | None:
    """KV cache bytes one token takes on one GPU (module docstring), or None where the formula does not apply."""
    if any(_field(hf_config, name) is not None for name in NON_STANDARD_CACHE_FIELDS):
        return None
    layer_types = _field(hf_config, "layer_types")
    if layer_types is _UNREADABLE or (layer_types and not set(layer_types) <= ATTENTION_LAYER_TYPES):
        return None
    values = {name: _field(hf_config, name) for name in
              ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "head_dim")}
    if _UNREADABLE in values.values():
        return None
    layers, heads, hidden = values["num_hidden_layers"], values["num_attention_heads"], values["hidden_size"]
    if not (layers and heads and hidden):
        return None
    kv_heads = values["num_key_value_heads"] or heads
    head_dim = values["head_dim"] or hidden // heads
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * bytes_per_value


def auto_kv_cache_bytes(bytes_per_token: int | None, sequences: int, tokens_per_sequence: int, max_seq_length: int,
                        margin: float = AUTO_MARGIN) -> int | None:
    """margin x sequences x tokens_per_sequence tokens, never below one max_seq_length sequence plus slack."""
    if bytes_per_token is None:
        return None
    tokens = max(math.ceil(margin * sequences * tokens_per_sequence), max_seq_length + FLOOR_SLACK_TOKENS)
    return tokens * bytes_per_token


def within_share(kv_bytes: int, share: float, gpu_total_bytes: int, weight_bytes: int) -> bool:
    """Whether kv_bytes is at most half of what the memory share leaves after the weights (module docstring)."""
    return kv_bytes <= (share * gpu_total_bytes - weight_bytes) / 2


SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                     "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_weight_bytes(model_path: str, tensor_parallel_size: int = 1, float_bytes: int = 2) -> int | None:
    """The bytes the checkpoint's tensors take on one GPU, floating-point ones in the engine's dtype (float_bytes),
    packed integer ones as stored; read from the safetensors headers alone (a hub id: from its copy in the local
    cache, which loading the policy has filled). None without safetensors files."""
    files = sorted(glob.glob(os.path.join(local_snapshot(model_path), "*.safetensors")))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as fh:  # an 8-byte little-endian header length, then the JSON header
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                dtype = entry["dtype"]
                size = float_bytes if dtype.startswith(("F", "BF")) else SAFETENSORS_BYTES.get(dtype, float_bytes)
                total += math.prod(entry["shape"]) * size
    return total // tensor_parallel_size


def local_snapshot(model_path: str) -> str:
    """A folder as it is; a hub id as its snapshot in the local Hugging Face cache (never downloaded here)."""
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
    except Exception:  # noqa: BLE001 -- not cached, or not a hub id: the caller keeps the share
        return model_path
