"""What a model's parts take, counted from its config alone: the model is built on PyTorch's meta device (no memory,
no weights read, ~1 s at 8B), so every architecture transformers builds is counted exactly, vision towers and
untied output layers included.

    P  every parameter                     Q  parameters qlora holds in 4 bits: linear layers and fused experts (not
    A  LoRA parameters: r (in + out)          the output layer, not the vision tower, not --qlora_skip_modules for
       per adapted linear layer,              linear layers; every 3-D parameter outside convolutions: the fused
       r (a + b) per expert of an             expert stacks grpo.model.quantized_experts quantizes)
       adapted [E, a, b] expert stack      V  parameters of the vision tower
                                           S  fused expert stacks (two per mixture-of-experts layer)

Bytes (b = 2 on a GPU's bf16, 4 on a CPU's fp32; a 4-bit value with bitsandbytes' double quantization takes
q = 1/2 + 1/block + 4 / (256 block) bytes: two values a byte, an 8-bit scale per block, an fp32 scale per 256 blocks,
block = --qlora_block_size, which the experts use too; each expert stack adds its two fp32 codebooks, 16 + 256 values):

    full   b P          lora   b P + b A          qlora  q Q + 4 (16 + 256) S + b (P - Q) + b A
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from grpo.config.strategy import Strategy
from grpo.memory.activations import ModelShape, model_shape


@dataclass(frozen=True)
class ModelSize:
    parameters: int        # P
    quantized: int         # Q: what qlora holds in 4 bits
    adapter: int           # A at --lora_rank over --lora_target_modules (0 for full)
    adapter_all_linear: int  # LoRA parameters at --lora_rank over every language linear layer (vLLM's LoRA slots)
    vision: int            # V
    largest_tensor: int    # elements of the largest parameter: a transient copy at load
    largest_layer: int     # parameters of the largest decoder layer: what a weight sync merges at once
    fused_experts: bool    # experts held as fused 3-D tensors (transformers converts them on load)
    shape: ModelShape
    expert_stacks: int = 0          # S: fused expert stacks (3-D parameters), in Q under qlora
    quantized_experts: int = 0      # their elements (the part of Q that is experts)
    adapted_expert_layer: int = 0   # elements of the adapted expert stacks of one layer (the most of any layer)
    largest_adapted_stack: int = 0  # elements of the largest adapted expert stack (E 2I H for gate_up_proj)
    adapted_expert_layers: int = 0  # layers whose expert stacks are adapted


CODEBOOK_BYTES = 4 * (16 + 256)  # one 4-bit stack's two fp32 codebooks: its 16 values and the nested scales' 256


def four_bit_bytes_per_value(block_size: int) -> float:
    """q: bytes per 4-bit value with double quantization (module docstring)."""
    return 0.5 + 1 / block_size + 4 / (256 * block_size)


def weight_bytes(size: ModelSize, strategy: Strategy, float_bytes: int = 2, block_size: int = 64) -> int:
    """The trainer's weights (module docstring's table), adapters included."""
    strategy = Strategy(strategy)
    adapter = float_bytes * size.adapter if strategy.has_adapter else 0
    if strategy.four_bit_base:
        q = four_bit_bytes_per_value(block_size)
        return (int(q * size.quantized) + CODEBOOK_BYTES * size.expert_stacks
                + float_bytes * (size.parameters - size.quantized) + adapter)
    return float_bytes * size.parameters + adapter


def build_on_meta(hf_config, trust_remote_code: bool = False):
    """The model as transformers builds it (AutoModelForCausalLM, or AutoModelForImageTextToText for a config with a
    vision_config), on the meta device: shapes without memory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(hf_config, "vision_config", None) is not None \
        else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(hf_config, trust_remote_code=trust_remote_code, dtype=torch.bfloat16)


def _matches(name: str, patterns) -> bool:
    """peft's module matching: a list matches a full name or its last parts, a string is a regex over full names."""
    if patterns is None:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def count_model(model, lora_rank: int, lora_targets, lora_exclude=None, qlora_skip=(),
                vision_towers: tuple[str, ...] = ()) -> ModelSize:
    """Count a built model's parts (module docstring). `lora_targets`: "all-linear" or module names (peft's rules);
    `vision_towers`: names of the vision tower modules, frozen and never adapted or quantized."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    towers = tuple(t + "." for t in vision_towers)
    parameters = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for name, p in model.named_parameters() if name.startswith(towers))
    quantized = adapter = adapter_all = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output or (name + ".").startswith(towers):
            continue
        per_lora = lora_rank * (module.in_features + module.out_features)
        adapter_all += per_lora
        if not _matches(name, list(qlora_skip)):
            quantized += module.weight.numel()
        wanted = lora_targets == "all-linear" or _matches(name, lora_targets)
        if wanted and not _matches(name, lora_exclude):
            adapter += per_lora
    stacks = _expert_stacks(model, towers)
    quantized_experts = sum(p.numel() for p in stacks.values())
    experts, adapted = _expert_adapter_values(model, lora_rank, lora_targets, towers)
    adapter, adapter_all = adapter + experts, adapter_all + experts
    layers = _decoder_layers(model, towers)
    largest_layer = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    fused = any(p.dim() == 3 for name, p in model.named_parameters()
                if not name.startswith(towers) and "conv" not in name and "patch_embed" not in name)
    per_layer: dict[str, int] = {}
    adapted = [name for name in adapted if name in stacks]
    for name in adapted:
        layer = name.rsplit(".", 1)[0]  # <layer>.mlp.experts.<parameter> -> its experts module
        per_layer[layer] = per_layer.get(layer, 0) + stacks[name].numel()
    return ModelSize(parameters, quantized + quantized_experts, adapter, adapter_all, vision,
                     max(p.numel() for p in model.parameters()), largest_layer, fused, model_shape(model.config),
                     expert_stacks=len(stacks), quantized_experts=quantized_experts,
                     adapted_expert_layer=max(per_layer.values(), default=0),
                     largest_adapted_stack=max((stacks[name].numel() for name in adapted), default=0),
                     adapted_expert_layers=len(per_layer))


def _expert_stacks(model, towers: tuple[str, ...]) -> dict:
    """name -> parameter of every fused expert stack qlora holds in 4 bits: the 3-D parameters outside convolutions
    (grpo.model.quantized_experts.fused_expert_slots' rule) and outside the vision towers."""
    import torch

    stacks = {}
    for mname, module in model.named_modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd) or (mname + ".").startswith(towers):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                stacks[f"{mname}.{pname}" if mname else pname] = param
    return stacks


def _expert_adapter_values(model, lora_rank: int, lora_targets, towers: tuple[str, ...]) -> tuple[int, list[str]]:
    """(values, adapted stacks' names): LoRA on a mixture of experts' fused expert tensors (grpo.model.expert_targets
    picks them): one rank-r LoRA per expert, r (a + b) values for each of the E experts of an [E, a, b] tensor."""
    import torch

    from grpo.model.expert_targets import expert_lora_targets

    if not lora_rank or not (lora_targets == "all-linear" or isinstance(lora_targets, list)):
        return 0, []
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    _, targets = expert_lora_targets(model, lora_targets, linear)
    if not targets:
        return 0, []
    total, names = 0, []
    for name, param in model.named_parameters():
        if param.dim() == 3 and not name.startswith(towers) and any(name.endswith("." + t) for t in targets):
            experts, a, b = param.shape
            total += experts * lora_rank * (a + b)
            names.append(name)
    return total, names


def _decoder_layers(model, towers: tuple[str, ...] = ()) -> list:
    """The repeated blocks of the language model: the longest ModuleList outside the vision tower."""
    import torch

    lists = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
             and not (name + ".").startswith(towers)]
    return list(max(lists, key=len)) if lists else []


def model_size(hf_config, config) -> ModelSize:
    """ModelSize of the model `hf_config` describes, trained with `config`'s LoRA and qlora options."""
    from grpo.model.vision import VISION_TOWERS

    model = build_on_meta(hf_config, config.trust_remote_code)
    targets = "all-linear" if config.lora_target_modules.strip() == "all-linear" else \
        [m.strip() for m in config.lora_target_modules.split(",") if m.strip()]
    towers = ()
    if getattr(hf_config, "vision_config", None) is not None:
        towers = tuple(name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in VISION_TOWERS)
    rank = config.lora_rank if config.uses_lora else 0
    return count_model(model, rank, targets, config.lora_exclude, config.qlora_skip_list, towers)
