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

so the step's rollouts fit at once; larger batches (an eval over more prompts) run in waves. auto asks for that size
where it is at most half of what the share leaves after the weights (the other half standing for vLLM's activations,
which only its own profiling knows). With lora / qlora, an engine that sleeps while the trainer runs and no
--gpu_memory_gib, it also asks for it where it is at most half of what the GPU has free once the weights are loaded
(and ENGINE_OWN_BYTES stay beside it): the cache is freed at every sleep, so it shares the GPU with the trainer's
persistent state alone, which adapters keep small (full fine-tuning's optimizer state comes after the engine starts
and is not counted here; an awake engine keeps its cache through training; torch's cap counts vLLM's pool even while
it sleeps). Under --gpu_memory_gib it also stays within half of what the cap leaves after the weights, with
ENGINE_OWN_BYTES beside it, as on a card of that size. A 32B qlora model in 4 bits (17.9 GiB of weights on an 80 GiB
GPU) needs 10 GiB for 8 x 8 sequences of 512 tokens, where the 0.3 share left 0.62 GiB and its rollouts took 70 s a
step. Otherwise the share sizes the cache.
Models whose cache is not one K and V per attention layer and token (MLA, hybrid linear-attention / state-space
stacks, per-layer head sizes) keep the share: kv_bytes_per_token returns None for them. A vision-language model's
cache is its language model's (its text_config); the memory its engine keeps for images is profiled by vLLM within
the half of the share that auto leaves beside the cache.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os

from grpo.model.base_weights import local_snapshot

logger = logging.getLogger("grpo")

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


def within_share(kv_bytes: int, share: float, gpu_total_bytes: int, weight_bytes: int) -> bool:
    """Whether kv_bytes is at most half of what the memory share leaves after the weights (module docstring)."""
    return kv_bytes <= (share * gpu_total_bytes - weight_bytes) / 2


# what a colocated engine takes beside its weights and KV cache (activations of a 16,384-token prefill chunk, the
# sampler, CUDA graphs): 5.3 GiB at Qwen2.5-32B's shape in 4 bits on an H100 (0.3 x 79.2 GiB less 17.9 of weights
# and 0.62 of cache), less for smaller models
ENGINE_OWN_BYTES = 6 * 2**30


def within_free(kv_bytes: int, free_bytes: int, weight_bytes: int) -> bool:
    """Whether kv_bytes is at most half of what the GPU's free memory leaves after the weights, with at least
    ENGINE_OWN_BYTES left beside it for the engine's own use (module docstring)."""
    room = free_bytes - weight_bytes
    return kv_bytes <= room / 2 and room - kv_bytes >= ENGINE_OWN_BYTES


INTEGER_BYTES = {"I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}  # safetensors dtypes


def checkpoint_weight_bytes(model_path: str, tensor_parallel_size: int = 1, float_bytes: int = 2) -> int | None:
    """The bytes the checkpoint's tensors take on one GPU, floating-point ones in the engine's dtype (float_bytes),
    packed integer ones as stored; read from the safetensors headers alone (a hub id: from its copy in the local
    cache, which loading the policy has filled). None without safetensors files."""
    files = sorted(glob.glob(os.path.join(local_snapshot(model_path) or model_path, "*.safetensors")))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as fh:  # an 8-byte little-endian header length, then the JSON header
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"]) * INTEGER_BYTES.get(entry["dtype"], float_bytes)
    return total // tensor_parallel_size


def share_holds(room_bytes: float, per_token: int, sequences: int, longest: int, needed_bytes: int) -> str:
    """What a cache left to the share means for the step's rollouts, said where it cannot hold them all at once:
    at most `room_bytes` (the share less the weights; vLLM's activations come off it too) holds about this many
    sequences of `longest` tokens; vLLM runs the rest as they free room (queued, or preempted and recomputed)."""
    at_once = max(0, int(room_bytes // (per_token * longest)))
    if at_once >= sequences:
        return ""
    return (f": at most {max(room_bytes, 0) / 2**30:.1f} GiB, about {at_once} of the step's {sequences} sequences "
            f"of {longest} tokens at once; vLLM queues and preempts the rest (slower rollouts, no failure). "
            f"--vllm_kv_cache_gib {math.ceil(needed_bytes / 2**30)} holds them all where the GPU has the room")


def completions_per_prompt(config) -> int:
    """The completions of each prompt one engine generates: --k_samples, or where a sequence-parallel group's
    engines generate in shares (--sequence_parallel_rollout share, an engine of one GPU) the largest share."""
    sp = getattr(config, "sequence_parallel_size", 1)
    if sp > 1 and config.sequence_parallel_rollout == "share" and config.vllm_tp == 1:
        from grpo.runtime.sequence_parallel import split_count

        return split_count(config.k_samples, 0, sp)  # the first rank's share is the largest
    return config.k_samples


def engine_kv_cache_bytes(config, model_path: str, gpu_total_bytes: int | None = None,
                          completion_tokens: int | None = None, gpu_free_bytes: int | None = None) -> int | None:
    """--vllm_kv_cache_gib in bytes per GPU: a number as given; auto sized to a colocated step's rollouts when that
    stays well within the memory share or, for adapters, the GPU's free memory (module docstring); None leaves vLLM
    the --vllm_gpu_memory_utilization share. `gpu_total_bytes`, `gpu_free_bytes`: this GPU's memory and what is free
    of it before the engine loads (default: asked of CUDA). `completion_tokens`: the longest a completion may grow (a
    multi-turn episode's token budget; default --rollout_max_new_tokens)."""
    choice = config.vllm_kv_cache
    if choice == "share":
        return None
    if choice != "auto":
        return int(choice * 2**30)
    import torch
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
    per_token = kv_bytes_per_token(hf_config, config.vllm_tp)
    if per_token is None:
        logger.info(f"vLLM KV cache: the memory share ({type(hf_config).__name__} keeps no plain per-token K/V "
                    "cache that --vllm_kv_cache_gib auto can size)")
        return None
    sequences = config.vllm_tp * config.per_device_train_batch_size * config.gradient_accumulation_steps \
        * completions_per_prompt(config)
    completion = completion_tokens or config.rollout_max_new_tokens
    longest = min(config.max_seq_length, config.max_prompt_length + completion)
    size = auto_kv_cache_bytes(per_token, sequences, longest, config.max_seq_length)
    if gpu_total_bytes is None and torch.cuda.is_available():
        gpu_free_bytes, gpu_total_bytes = torch.cuda.mem_get_info()
    weights = checkpoint_weight_bytes(model_path, config.vllm_tp)
    if weights is None:
        logger.info(f"vLLM KV cache: the memory share (no safetensors files found for {model_path}, so auto cannot "
                    "tell how much of the share the weights take)")
        return None
    where = ""
    # vLLM's share is of what the job may use: under --gpu_memory_gib, of the cap (gpu_budget.engine_memory_share)
    job_bytes = min(gpu_total_bytes, int(config.gpu_memory_gib * 2**30)) if gpu_total_bytes and config.gpu_memory_gib \
        else gpu_total_bytes

    def left_to_share(too_much: str) -> None:
        """Says why the cache is left to the share, and what the share means for the step's rollouts."""
        logger.info(f"vLLM KV cache: the memory share (the step's rollouts need {size / 2**30:.2f} GiB, more than "
                    f"{too_much})" + share_holds(config.vllm_memory_share * job_bytes - weights, per_token, sequences,
                                                 longest, size))

    if job_bytes and config.gpu_memory_gib and not within_free(size, job_bytes, weights):
        # a capped GPU is treated as a card of the cap's size: the cache stays within half of what the cap leaves
        # after the weights, as on that card (where a 0.3 share of a large GPU would take most of the cap)
        left_to_share(f"half of what --gpu_memory_gib {config.gpu_memory_gib:g} leaves after {weights / 2**30:.2f} GiB "
                      "of weights, or too little beside it")
        return None
    if gpu_total_bytes and not within_share(size, config.vllm_memory_share, gpu_total_bytes, weights):
        # the free memory counts only where the cache goes at every sleep: not awake through training, and not
        # under --gpu_memory_gib, whose cap on torch counts vLLM's pool even while it sleeps
        by_free = config.tuning_strategy in ("lora", "qlora") and config.vllm_sleep and not config.gpu_memory_gib \
            and gpu_free_bytes is not None
        if not (by_free and within_free(size, gpu_free_bytes, weights)):
            left_to_share(f"half of what --vllm_gpu_memory_utilization {config.vllm_memory_share} leaves after "
                          f"{weights / 2**30:.2f} GiB of weights" + (f", and of what the GPU's "
                          f"{gpu_free_bytes / 2**30:.1f} GiB free leave" if by_free else ""))
            return None
        where = (f"; more than the {config.vllm_memory_share:g} share leaves, within half of the "
                 f"{gpu_free_bytes / 2**30:.1f} GiB free beside {weights / 2**30:.2f} GiB of weights")
    logger.info(f"vLLM KV cache: {size / 2**30:.2f} GiB per GPU (auto: {sequences} sequences x {longest} tokens x "
                f"{per_token / 1024:.1f} KiB per token, +25%{where})")
    return size

