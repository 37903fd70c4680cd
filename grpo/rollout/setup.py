"""Which rollout engine a training rank gets, and what it computes in."""
from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from .hf import HFRolloutEngine, stop_token_ids
from .kv_cache import auto_kv_cache_bytes, checkpoint_weight_bytes, kv_bytes_per_token, within_share

logger = logging.getLogger("grpo")


def engine_holds_weights(config) -> bool:
    """Whether the engine has weights of its own to sync (vLLM, or the rollout ranks of server mode); the colocated
    HF engine samples the live policy module."""
    return config.use_vllm_rollout or config.vllm_mode == "server"


def engine_dtype(config, trainer_dtype: torch.dtype) -> torch.dtype:
    """What the engine computes in, so what the sync sends: vLLM bf16; an HF engine the trainer's own dtype."""
    return torch.bfloat16 if config.use_vllm_rollout else trainer_dtype


def build_rollout_engine(config, model_path: str, policy, tokenizer, vision, rank: int, trainer_dtype: torch.dtype):
    """Server mode: the rollout ranks, reached through RemoteRolloutEngine; otherwise a colocated vLLM engine, or
    the HF engine over the policy module itself."""
    stops = stop_token_ids(policy, tokenizer)
    if config.vllm_mode == "server":
        from .remote import RemoteRolloutEngine

        spec = dict(dtype=str(engine_dtype(config, trainer_dtype)).removeprefix("torch."), stop_token_ids=stops,
                    max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                    image_token_id=vision.image_token_id if vision else None,
                    suppress_token_ids=vision.placeholder_token_ids if vision else None)
        logger.info(f"waiting for {config.rollout_gpus} rollout rank(s) to start their engines")
        return RemoteRolloutEngine(spec, config.rollout_gpus, config.ddp_timeout_minutes,
                                   images_as_decoded=config.use_vllm_rollout)
    if config.use_vllm_rollout:
        from .vllm import VLLMRolloutEngine

        # ranks of one tensor-parallel group share a seed: they must sample the same completions
        return VLLMRolloutEngine(model_path, tensor_parallel_size=config.vllm_tp,
                                 gpu_memory_utilization=config.vllm_memory_share,
                                 kv_cache_bytes=engine_kv_cache_bytes(config, model_path),
                                 max_model_len=config.max_seq_length, seed=config.seed + rank // config.vllm_tp,
                                 enable_sleep=config.vllm_sleep,
                                 sleep_level=config.vllm_sleep_level, enforce_eager=config.vllm_enforce_eager,
                                 stop_token_ids=stops,
                                 max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                                 image_token_id=vision.image_token_id if vision else None)
    return HFRolloutEngine(policy, tokenizer, suppress_token_ids=vision.placeholder_token_ids if vision else None)


def engine_kv_cache_bytes(config, model_path: str, gpu_total_bytes: int | None = None) -> int | None:
    """--vllm_kv_cache_gib in bytes per GPU: a number as given; auto sized to a colocated step's rollouts when that
    stays well within the memory share (kv_cache.py); None leaves vLLM the --vllm_gpu_memory_utilization share.
    `gpu_total_bytes`: this GPU's memory (default: asked of CUDA)."""
    choice = config.vllm_kv_cache
    if choice == "share":
        return None
    if choice != "auto":
        return int(choice * 2**30)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
    per_token = kv_bytes_per_token(hf_config, config.vllm_tp)
    if per_token is None:
        logger.info(f"vLLM KV cache: the memory share ({type(hf_config).__name__} keeps no plain per-token K/V "
                    "cache that --vllm_kv_cache_gib auto can size)")
        return None
    sequences = config.vllm_tp * config.per_device_train_batch_size * config.gradient_accumulation_steps \
        * config.k_samples
    longest = min(config.max_seq_length, config.max_prompt_length + config.rollout_max_new_tokens)
    size = auto_kv_cache_bytes(per_token, sequences, longest, config.max_seq_length)
    if gpu_total_bytes is None and torch.cuda.is_available():
        gpu_total_bytes = torch.cuda.mem_get_info()[1]
    weights = checkpoint_weight_bytes(model_path, config.vllm_tp)
    if weights is None:
        logger.info(f"vLLM KV cache: the memory share (no safetensors files found for {model_path}, so auto cannot "
                    "tell how much of the share the weights take)")
        return None
    if gpu_total_bytes and not within_share(size, config.vllm_memory_share, gpu_total_bytes, weights):
        logger.info(f"vLLM KV cache: the memory share (the step's rollouts need {size / 2**30:.2f} GiB, more than "
                    f"half of what --vllm_gpu_memory_utilization {config.vllm_memory_share} leaves after "
                    f"{weights / 2**30:.2f} GiB of weights)")
        return None
    logger.info(f"vLLM KV cache: {size / 2**30:.2f} GiB per GPU (auto: {sequences} sequences x {longest} tokens x "
                f"{per_token / 1024:.1f} KiB per token, +25%)")
    return size


def check_tensor_parallel(model_path: str, config) -> None:
    """vLLM splits attention heads over the group: say so now rather than after the models load."""
    from transformers import AutoConfig

    heads = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code),
                    "num_attention_heads", None)
    if heads and heads % config.vllm_tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"--vllm_tp {config.vllm_tp}: the model has {heads} attention heads, which tensor "
                          f"parallelism must divide; use one of {divisors}")
