"""Which rollout engine a training rank gets, and what it computes in."""
from __future__ import annotations

import logging

import torch

from grpo.errors import ConfigError
from grpo.rollout.hf import HFRolloutEngine, stop_token_ids
from grpo.rollout.kv_cache import engine_kv_cache_bytes

logger = logging.getLogger("grpo")


def engine_holds_weights(config) -> bool:
    """Whether the engine has weights of its own to sync (vLLM, or the rollout ranks of server mode); the colocated
    HF engine samples the live policy module."""
    return config.uses_vllm or config.rollout_mode == "server"


def engine_dtype(config, trainer_dtype: torch.dtype) -> torch.dtype:
    """What the engine computes in, so what the sync sends: vLLM bf16; an HF engine the trainer's own dtype."""
    return torch.bfloat16 if config.uses_vllm else trainer_dtype


def build_rollout_engine(config, model_path: str, policy, tokenizer, vision, rank: int, trainer_dtype: torch.dtype):
    """Server mode: the rollout ranks, reached through RemoteRolloutEngine; otherwise a colocated vLLM engine, or
    the HF engine over the policy module itself."""
    stops = stop_token_ids(policy, tokenizer)
    if config.rollout_mode == "server":
        from grpo.rollout.remote import RemoteRolloutEngine

        spec = dict(dtype=str(engine_dtype(config, trainer_dtype)).removeprefix("torch."), stop_token_ids=stops,
                    max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                    image_token_id=vision.image_token_id if vision else None,
                    suppress_token_ids=vision.placeholder_token_ids if vision else None)
        logger.info(f"waiting for {config.rollout_gpus} rollout rank(s) to start their engines")
        return RemoteRolloutEngine(spec, config.rollout_gpus, config.ddp_timeout_minutes,
                                   images_as_decoded=config.uses_vllm)
    if config.uses_vllm:
        from grpo.rollout.vllm import VLLMRolloutEngine

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


def check_tensor_parallel(model_path: str, config) -> None:
    """vLLM splits attention heads over the group: say so now rather than after the models load."""
    from transformers import AutoConfig

    heads = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code),
                    "num_attention_heads", None)
    if heads and heads % config.vllm_tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"--vllm_tp {config.vllm_tp}: the model has {heads} attention heads, which tensor "
                          f"parallelism must divide; use one of {divisors}")
