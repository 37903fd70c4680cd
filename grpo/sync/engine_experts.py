"""Where a vLLM engine holds a mixture of experts' fused expert tensors, so that the trainer's frozen experts can
become views of the engine's (grpo.sync.shared_base) in adapter mode.

vLLM 0.26's FusedMoE keeps each layer's experts as two fused tensors of the same layout as transformers 5's,

    <moe>.experts.w13_weight   [E, 2I, H]   expert e's w1 (gate) rows, then its w3 (up) rows   = experts.gate_up_proj
    <moe>.experts.w2_weight    [E, H, I]                                                       = experts.down_proj

(vllm/model_executor/layers/fused_moe/routed_experts.py build_expert_params_mapping: `experts.w13_` / `experts.w2_`),
under the checkpoint's module path (<moe>: Mixtral's block_sparse_moe, Qwen3-MoE's mlp). Which of the trainer's
fused tensors is which is read from the checkpoint tensors each one reverts to: two per expert (gate, up) is w13,
one (down) is w2. The engine may still hold them otherwise (a kernel's own layout, a quantized or sharded weight):
sharing compares every element first, and keeps the trainer's copy where they differ.
"""
from __future__ import annotations

import torch

from grpo.errors import ConfigError
from grpo.sync.engine_layout import engine_names
from grpo.sync.expert_adapters import checkpoint_row_blocks

VLLM_FUSED = {2: "w13_weight", 1: "w2_weight"}  # checkpoint tensors per expert -> vLLM's fused tensor


def engine_expert_names(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> dict[str, str]:
    """The trainer's fused expert tensors (`shapes`: live name -> shape; `model` the base model) -> the checkpoint
    name vLLM's fused tensor of the same values has, e.g. model.layers.0.mlp.experts.gate_up_proj ->
    model.layers.0.block_sparse_moe.experts.w13_weight."""
    names = {}
    for name, shape in shapes.items():
        if len(shape) != 3:
            continue
        try:
            blocks = checkpoint_row_blocks(model, name, torch.Size(shape))
        except ConfigError:  # not converted on load, or not rows of one expert: no such engine tensor
            continue
        first = [b for b in blocks if b.expert == 0]
        fused = VLLM_FUSED.get(len(first))
        tiled = [b.start for b in first] == [0] + [b.stop for b in first[:-1]] and first[-1].stop == shape[1]
        if fused is None or not tiled or ".experts." not in first[0].name:
            continue
        names[name] = first[0].name.split(".experts.")[0] + ".experts." + fused
    return names


def engine_expert_blocks(engine_model: torch.nn.Module, model: torch.nn.Module,
                         shapes: dict[str, torch.Size]) -> dict[str, tuple[torch.Tensor, int]]:
    """live name -> (the engine's fused expert tensor, first row 0) for the trainer's fused experts that the engine
    holds under vLLM's names (grpo.sync.engine_layout.engine_blocks' form)."""
    if not any(len(shape) == 3 for shape in shapes.values()):
        return {}
    to_engine = engine_names(engine_model)
    engine = {name.replace(".base_layer", ""): p for name, p in engine_model.named_parameters()}
    blocks = {}
    for live, checkpoint in engine_expert_names(model, shapes).items():
        renamed = to_engine(checkpoint)
        if renamed in engine:
            blocks[live] = (engine[renamed], 0)
    return blocks
