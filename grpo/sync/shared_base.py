"""lora with an engine that takes the adapter: one 16-bit base on the GPU, shared by the trainer and vLLM.

Both load the same checkpoint, so their frozen base weights are equal; once the colocated engine is up, each of the
trainer's frozen base tensors becomes a view of the engine's own block of rows (grpo.sync.engine_layout: fused
layers, padded vocabularies), and the trainer's copy is freed. A tensor is shared only if the
engine's block has its shape and dtype and is equal to it element for element; anything else keeps its own copy.
While the engine loads, the trainer's base waits in CPU memory (park_frozen_base), so the GPU never holds two.
The engine must then never release its weights (it sleeps by dropping its KV cache only), and the base is never
synced: the adapter is all that changes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo.model.layer_weights import checkpoint_name
from grpo.sync.engine_experts import engine_expert_blocks
from grpo.sync.engine_layout import engine_blocks

logger = logging.getLogger("grpo")


@dataclass
class SharedBase:
    shared: int = 0         # trainer tensors now viewing the engine's
    kept: int = 0           # frozen tensors with no equal block in the engine: the trainer's own copy stays
    shared_bytes: int = 0   # the trainer's memory given back
    kept_names: list = field(default_factory=list)  # the checkpoint names of the `kept` tensors


def frozen_base(policy: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """checkpoint name -> the policy's frozen base tensor (LoRA's own parameters left out)."""
    return {checkpoint_name(name): p for name, p in policy.named_parameters()
            if not p.requires_grad and "lora_" not in name}


def park_frozen_base(policy: torch.nn.Module) -> dict[str, torch.device]:
    """Move the frozen base to CPU memory while the engine loads its own copy, so that the GPU never holds both;
    share_base_weights then puts each tensor back as a view of the engine's (or, if it has no equal one, back where
    it was). Returns where each moved tensor was. A ZeRO-3 partition stays: it is not the whole tensor."""
    parked = {}
    for name, param in frozen_base(policy).items():
        if param.device.type != "cpu" and param.numel() and not hasattr(param, "ds_id"):
            parked[name] = param.device
            param.data = param.data.to("cpu")
    if parked and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engine about to load takes this memory
    return parked


def restore_parked(policy: torch.nn.Module, parked: dict[str, torch.device]) -> None:
    """Put the tensors park_frozen_base moved back where they were (the engine did not come up)."""
    for name, param in frozen_base(policy).items():
        if name in parked:
            param.data = param.data.to(parked[name])


def lora_base_names(policy: torch.nn.Module) -> set[str]:
    """The checkpoint names of the base weights the policy's LoRA layers adapt."""
    return {checkpoint_name(f"{name}.weight") for name, module in policy.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "get_base_layer")}


def share_base_weights(policy: torch.nn.Module, engine_model: torch.nn.Module,
                       packed: Optional[dict[str, list[str]]] = None,
                       parked: Optional[dict[str, torch.device]] = None,
                       required: Optional[set[str]] = None) -> SharedBase:
    """Make the policy's frozen base tensors views of `engine_model`'s equal ones; the trainer's copies are freed.
    `parked`: tensors park_frozen_base moved to CPU memory; those with no equal block go back to their device.
    `required`: names that must all be shared, or nothing is (every tensor then stays the trainer's own)."""
    frozen = frozen_base(policy)
    shapes = {name: p.shape for name, p in frozen.items()}
    blocks = engine_blocks(engine_model, packed or {}, shapes)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    blocks.update(engine_expert_blocks(engine_model, base, shapes))  # a mixture of experts' fused experts
    parked = dict(parked or {})
    result = SharedBase()
    views = {name: _equal_block(param, *blocks[name]) if name in blocks else None for name, param in frozen.items()}
    if required and any(views.get(name) is None for name in required):
        views = dict.fromkeys(views)
    for name, param in frozen.items():
        view = views[name]
        if view is None:
            result.kept += 1
            result.kept_names.append(name)
            continue
        result.shared_bytes += param.numel() * param.element_size()
        param.data = view
        result.shared += 1
        parked.pop(name, None)
    restore_parked(policy, parked)  # what has no equal block in the engine goes back where it was
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed copies go back to the device, for activations and the KV cache
    return result


def _equal_block(param: torch.Tensor, engine_tensor: torch.Tensor, first: int) -> Optional[torch.Tensor]:
    """engine_tensor's rows [first, first + len(param)) if they are param's values exactly, else None."""
    rows = param.shape[0] if param.dim() else 0
    engine_tensor = engine_tensor.data  # (vLLM's bitsandbytes weight reports the model's dtype, not its bytes')
    if param.numel() == 0 or hasattr(param, "ds_id"):  # a ZeRO-3 partition: the full tensor is not this one
        return None
    if (engine_tensor.dtype != param.dtype or engine_tensor.shape[1:] != param.shape[1:]
            or first + rows > engine_tensor.shape[0]):
        return None
    view = engine_tensor[first:first + rows] if param.dim() else engine_tensor
    # (a parked tensor is compared on the engine's device, one at a time)
    if view.shape != param.shape or not torch.equal(view, param.data.to(view.device)):
        return None
    return view
