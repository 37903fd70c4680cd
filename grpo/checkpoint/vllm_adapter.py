"""Beside a saved adapter with LoRA on a mixture of experts' fused experts, the same adapter in the form vLLM 0.26
loads (lora_adapter/vllm/): peft saves the experts' fused factors (`experts.base_layer.lora_A` [E*r, H] ...), which
vLLM takes for models it holds as 3-D experts only (GPT-OSS, Qwen3.5), while for Mixtral and Qwen3-MoE it reads one
LoRA per expert and checkpoint tensor (grpo.sync.expert_adapters):

    vllm serve <base> --enable-lora --max-lora-rank <r> --lora-modules policy=<output>/lora_adapter/vllm

Every lora_B there is scaled by its layer's alpha / r and the config's lora_alpha equals r, so vLLM's own scale is 1
(rank and alpha patterns included). The trainer's in-memory sync to vLLM sends the very same tensors.
"""
from __future__ import annotations

import json
import logging
import os

from grpo.sync.expert_adapters import expert_wrappers

logger = logging.getLogger("grpo")
VLLM_FOLDER = "vllm"


def has_expert_adapters(model) -> bool:
    return any(expert_wrappers(module) for module in model.modules())


def write_vllm_adapter(model, adapter_dir: str, base_model: str) -> str:
    """Write `model`'s adapter (a peft model with LoRA on fused experts, parameters whole: not ZeRO-3 partitioned)
    to adapter_dir/vllm as vLLM loads it; returns that folder."""
    from safetensors.torch import save_file

    from grpo.sync.weight_sync import iter_adapter_tensors

    dtype = next(p.dtype for name, p in model.named_parameters() if "lora_A" in name)
    tensors = {name: t.contiguous() for name, t in iter_adapter_tensors(model, dtype=dtype)}
    rank = max(t.shape[0] for name, t in tensors.items() if name.endswith(".lora_A.weight"))
    modules = sorted({name.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for name in tensors
                      if name.endswith(".lora_A.weight")})
    folder = os.path.join(adapter_dir, VLLM_FOLDER)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
              "lora_alpha": rank, "target_modules": modules, "bias": "none", "use_rslora": False, "use_dora": False,
              "lora_dropout": 0.0}
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    logger.info(f"the adapter as vLLM loads it for this mixture of experts (one LoRA per expert): {folder}")
    return folder
