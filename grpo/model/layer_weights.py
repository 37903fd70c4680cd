"""What the policy's layers hold, as the rest of the library reads them: the checkpoint name of a peft module, a
weight's dense values (4-bit ones dequantized with their quant_state), and the active LoRA adapters of a layer.

Model loading (4-bit rounding, LoftQ, the quantized checkpoint) and the engine weight transfer (grpo.sync) both read
layers this way; this module imports neither of them.
"""
from __future__ import annotations

import torch

from grpo.errors import ConfigError

PEFT_PREFIX = "base_model.model."


def checkpoint_name(module_name: str) -> str:
    """peft's module path -> the name the base checkpoint (and vLLM's load_weights) uses."""
    name = module_name[len(PEFT_PREFIX):] if module_name.startswith(PEFT_PREFIX) else module_name
    return name.replace(".base_layer", "")


def is_4bit(weight) -> bool:
    return weight is not None and weight.__class__.__name__ == "Params4bit"


def dense_weight(layer) -> torch.Tensor:
    """The layer's weight as a new dense fp32 tensor (4-bit weights dequantized with their quant_state)."""
    stored = stored_weight(layer.weight)
    return stored.float() if is_4bit(layer.weight) else stored.to(torch.float32, copy=True)  # (a merge adds into it)


def write_weight(out: torch.Tensor, weight) -> torch.Tensor:
    """out <- the weight's values; a 4-bit weight on the GPU dequantized straight into `out` where its dtype is out's
    (no dense copy in between: 33 -> 24 ms for a merged sync of Qwen2.5-7B's linears on an H100; bitsandbytes 0.50
    has no such kernel on CPU)."""
    if is_4bit(weight) and out.is_cuda and weight.quant_state.dtype == out.dtype and out.is_contiguous():
        import bitsandbytes.functional as bnbf

        _refuse_repacked(weight)
        return bnbf.dequantize_4bit(weight.data, weight.quant_state, out=out)
    return out.copy_(stored_weight(weight))


def stored_weight(weight) -> torch.Tensor:
    """What the weight holds, dense: a 4-bit weight dequantized (in its quant_state's dtype), any other as it is."""
    if is_4bit(weight):
        import bitsandbytes.functional as bnbf

        _refuse_repacked(weight)
        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    return weight.data


def _refuse_repacked(weight) -> None:
    if getattr(weight.quant_state, "packing_format_for_cpu", False):
        raise ConfigError("a 4-bit layer was repacked by bitsandbytes' bf16 CPU inference path, so its weight no "
                          "longer dequantizes to the trained policy; load the policy with "
                          "grpo.model.loading.load_policy (or call grpo.model.loading.keep_4bit_forward_exact on "
                          "it first)")


def active_adapters(module) -> list[str]:
    """The adapter names a peft module runs (peft keeps one name or a list)."""
    active = getattr(module, "active_adapters", None) or getattr(module, "active_adapter", "default")
    return [active] if isinstance(active, str) else list(active)


def lora_adapters(module) -> list[str]:
    """The active, unmerged adapters of a LoRA layer; a clear error for layer kinds the
    sync's merge (grpo.sync.weight_sync) cannot do."""
    active = active_adapters(module)
    if any(a in getattr(module, "lora_embedding_A", {}) for a in active):
        raise ConfigError("weight sync merges LoRA on linear layers only; drop embedding layers from "
                          "--lora_target_modules")
    adapters = [a for a in active if a in module.lora_A and a not in getattr(module, "merged_adapters", [])]
    for a in adapters:
        if a in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(a, False):
            raise ConfigError("weight sync merges plain LoRA (W + s * B @ A); DoRA and other LoRA variants are "
                              "not supported: train without use_dora")
        if not isinstance(module.lora_A[a], torch.nn.Linear):
            raise ConfigError(f"weight sync merges LoRA on linear layers only, not {type(module.lora_A[a]).__name__}"
                              "; drop those layers from --lora_target_modules")
    return adapters


def plain_lora(module, adapters: list[str]) -> bool:
    """Whether the merge is W + s * B @ A on the weight alone, as grpo.sync.weight_sync._lora_merged_into
    writes it."""
    return not getattr(module, "fan_in_fan_out", False) and not any(
        getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
