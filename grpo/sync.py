"""Weight sync: the policy being trained, as HF-checkpoint (name, tensor) pairs for a rollout engine.

Streamed one module at a time, so memory stays bounded by the largest layer:
  full   the parameters as trained (ZeRO-3: gathered one module at a time, never the whole model)
  lora   only the LoRA-targeted weights, merged on the fly:  W + (alpha / r) * B @ A
         (the training model is never merged / unmerged)
  qlora  dequantize_4bit(W) + (alpha / r) * B @ A, and on the first sync every other 4-bit linear dequantized,
         so the engine samples from exactly the quantized policy being trained
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch

PEFT_PREFIX = "base_model.model."


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int


def checkpoint_name(module_name: str) -> str:
    """peft's module path -> the name the base checkpoint (and vLLM's load_weights) uses."""
    name = module_name[len(PEFT_PREFIX):] if module_name.startswith(PEFT_PREFIX) else module_name
    return name.replace(".base_layer", "")


def _gathered(params: list, zero3: bool):
    if not zero3 or not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _dense_weight(layer) -> torch.Tensor:
    """The layer's weight as a dense float tensor (4-bit weights dequantized)."""
    weight = layer.weight
    if weight.__class__.__name__ == "Params4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
    return weight.data.float()


def _lora_delta(module, adapter: str) -> torch.Tensor:
    """(alpha / r) * B @ A for one adapter, oriented like the base weight [out, in]."""
    a = module.lora_A[adapter].weight.float()            # [r, in]
    b = module.lora_B[adapter].weight.float()            # [out, r]
    delta = (b @ a) * module.scaling[adapter]             # [out, in]
    return delta.T if getattr(module, "fan_in_fan_out", False) else delta


def iter_policy_weights(model, strategy: str, *, dtype: torch.dtype = torch.bfloat16, zero3: bool = False,
                        first_sync: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor in `dtype`) for what the rollout engine must load after a step."""
    if strategy == "full":
        yield from _iter_full(model, dtype, zero3)
    elif strategy in ("lora", "qlora"):
        yield from _iter_lora(model, dtype, zero3, include_frozen_4bit=first_sync and strategy == "qlora")
    else:
        raise ValueError(f"unknown tuning strategy '{strategy}'")


def _iter_full(model, dtype, zero3):
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        with _gathered([p for _, p in params], zero3):
            for name, param in params:
                full_name = f"{module_name}.{name}" if module_name else name
                yield checkpoint_name(full_name), param.data.to(dtype).clone() if zero3 else param.data.to(dtype)


def _iter_lora(model, dtype, zero3, include_frozen_4bit: bool):
    from peft.tuners.lora import LoraLayer

    adapter = getattr(model, "active_adapter", "default")
    adapter = adapter[0] if isinstance(adapter, (list, tuple)) else adapter
    wrapped = set()
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            base = module.get_base_layer()
            wrapped.add(id(base))
            params = [base.weight, module.lora_A[adapter].weight, module.lora_B[adapter].weight]
            with _gathered(params, zero3):
                merged = _dense_weight(base) + _lora_delta(module, adapter)   # [out, in], fp32
                yield checkpoint_name(module_name) + ".weight", merged.to(dtype)
    if include_frozen_4bit:
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            # LoRA wrappers expose their base layer's weight too: only bare 4-bit linears are left here
            if isinstance(module, LoraLayer) or id(module) in wrapped:
                continue
            if weight is not None and weight.__class__.__name__ == "Params4bit":
                yield checkpoint_name(module_name) + ".weight", _dense_weight(module).to(dtype)


def sync_weights(engine, model, strategy: str, *, zero3: bool = False, first_sync: bool = False,
                 dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = 256 * 2**20) -> SyncStats:
    """Stream the policy's weights into `engine.load_weights` in chunks of at most ~chunk_bytes."""
    start = time.perf_counter()
    total, count, chunk, chunk_size = 0, 0, [], 0
    for name, tensor in iter_policy_weights(model, strategy, dtype=dtype, zero3=zero3, first_sync=first_sync):
        chunk.append((name, tensor))
        size = tensor.numel() * tensor.element_size()
        chunk_size += size
        total += size
        count += 1
        if chunk_size >= chunk_bytes:
            engine.load_weights(chunk)
            chunk, chunk_size = [], 0
    if chunk:
        engine.load_weights(chunk)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncStats(seconds=time.perf_counter() - start, bytes=total, tensors=count)
