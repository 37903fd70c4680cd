"""Where a colocated vLLM engine holds each of the checkpoint's tensors.

vLLM fuses some layers (`packed_modules_mapping`, e.g. qkv_proj = [q_proj; k_proj; v_proj] stacked by rows,
gate_up_proj = [gate_proj; up_proj]), pads the vocabulary rows of its embedding and output layer, and with LoRA
enabled names a wrapped layer's weight `<layer>.base_layer.weight`. So a checkpoint tensor is a block of rows of an
engine tensor:

    q_proj.weight    = qkv_proj.weight[0 : q]          k_proj.weight = qkv_proj.weight[q : q + k]    ...
    embed_tokens     = embed_tokens.weight[0 : vocab]  (rows past the vocabulary are vLLM's padding)

Rows of a row-major tensor are contiguous, so every block is a plain dense tensor: the trainer can share it
(grpo.sync.shared_base) or write the synced policy into it (grpo.sync.weight_sync). Names are the checkpoint's,
renamed as the engine's model renames them when it loads (engine_names: a vision-language model's prefixes).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def engine_blocks(engine_model: torch.nn.Module, packed: dict[str, list[str]], shapes: dict[str, torch.Size]):
    """checkpoint name -> (engine tensor, first row) for every trainer tensor the engine holds: by the same name, or
    as one part of a fused layer (its rows after those of the parts before it, sized by the trainer's `shapes`)."""
    return {name: (tensor, first) for name, (tensor, first, _) in _blocks(engine_model, packed, shapes).items()}


def writable_blocks(engine_model: torch.nn.Module, packed: dict[str, list[str]],
                    shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """checkpoint name -> the rows of an engine tensor that hold exactly that tensor, for a sync that writes the
    policy there in place. Only where the blocks tile the engine tensor whole (a tensor of the same shape, or every
    part of a fused layer) in a floating-point type: a padded vocabulary, a tensor-parallel shard or a quantized
    tensor is left to the engine's own loaders."""
    views = {}
    for name, (tensor, first, parts) in _blocks(engine_model, packed, shapes).items():
        data, shape = tensor.data, shapes[name]  # (vLLM's bitsandbytes weight reports the model's dtype, not its bytes')
        if (data.dim() == 0 or len(shape) != data.dim() or data.shape[1:] != shape[1:]
                or sum(shapes[p][0] for p in parts) != data.shape[0]
                or not data.dtype.is_floating_point or not data.is_contiguous()):
            continue
        views[name] = data[first:first + shape[0]]
    return views


def engine_names(engine_model: torch.nn.Module) -> Callable[[str], Optional[str]]:
    """checkpoint name -> the engine's name of that tensor before any fusing (None: the engine drops it), as the
    model's own loader renames it: vLLM's `hf_to_vllm_mapper` without its stacked part (q_proj -> qkv_proj is
    `packed`'s business here). A vision-language model's model.language_model.* becomes language_model.model.*,
    model.visual.* visual.* (vLLM 0.26, Qwen2-VL / Qwen2.5-VL); a text model's names mostly stay."""
    mapper = getattr(engine_model, "hf_to_vllm_mapper", None)
    unstacked = getattr(mapper, "get_unstacked_mapper", None)
    if unstacked is None:
        return lambda name: name
    renames = unstacked()
    return renames._map_name


def _blocks(engine_model: torch.nn.Module, packed: dict[str, list[str]], shapes: dict[str, torch.Size]):
    """checkpoint name -> (engine tensor, first row, the checkpoint names whose rows share that tensor, in order)."""
    to_engine = engine_names(engine_model)
    checkpoint = {}  # the engine's name -> the checkpoint's
    for name in shapes:
        renamed = to_engine(name)
        if renamed is not None:
            checkpoint[renamed] = name
    found = _engine_blocks(engine_model, packed, {new: shapes[old] for new, old in checkpoint.items()})
    return {checkpoint[name]: (tensor, first, [checkpoint[p] for p in parts])
            for name, (tensor, first, parts) in found.items()}


def _engine_blocks(engine_model: torch.nn.Module, packed: dict[str, list[str]], shapes: dict[str, torch.Size]):
    """As _blocks, with the tensors under the engine's names (`shapes`' keys)."""
    engine = {name.replace(".base_layer", ""): p for name, p in engine_model.named_parameters()}
    blocks = {}
    for name in shapes:
        if name in engine:
            blocks[name] = (engine[name], 0, [name])
            continue
        prefix, _, leaf = name.rpartition(".")  # e.g. model.layers.0.self_attn.q_proj, weight
        parent, _, module = prefix.rpartition(".")
        for fused, parts in packed.items():
            if module not in parts:
                continue
            fused_name = f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"
            siblings = [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in parts]
            if fused_name in engine and all(s in shapes for s in siblings):
                first = sum(shapes[s][0] for s in siblings[:parts.index(module)])
                blocks[name] = (engine[fused_name], first, siblings)
            break
    return blocks
