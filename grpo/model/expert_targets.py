"""What LoRA adapts on a mixture of experts whose experts transformers holds as fused 3-D parameters (Mixtral,
Qwen3-MoE: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]).

peft adapts such a parameter with a ParamWrapper (`target_parameters`), one rank-r LoRA per expert held in two
fused factors (grpo.sync.expert_adapters). Left to itself, peft maps the checkpoint's per-expert names in
`target_modules` (w1 / w3 / gate_proj / up_proj: the fused gate_up_proj, at rank 2r; `gate`: the router) onto
these parameters; grpo names the parameters itself instead, so that every expert projection has the rank asked
for and the router stays frozen (vLLM's LoRA is not checked on it, and routing replay reads the trainer's router).

    "all-linear"                    the linear layers (attention) + every fused expert parameter
    a list naming expert parts      gate_proj / up_proj / w1 / w3 / gate_up_proj -> experts.gate_up_proj,
                                    down_proj / w2 -> experts.down_proj, experts -> all of them
"""
from __future__ import annotations

import torch

from grpo.errors import ConfigError


# the per-expert names of the published checkpoints (Mixtral, Qwen-MoE) -> the fused parameter that holds them
EXPERT_PARTS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                "gate_up_proj": "gate_up_proj", "w2": "down_proj", "down_proj": "down_proj"}
ALL_EXPERTS = "experts"
ROUTERS = ("gate", "router")


def fused_expert_parameters(model) -> list[str]:
    """`<module>.<parameter>` suffixes of the model's 3-D weights outside convolutions, e.g. experts.gate_up_proj:
    the fused experts, as peft's `target_parameters` takes them."""
    found = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                found.add(f"{name.rsplit('.', 1)[-1]}.{pname}")
    return sorted(found)


def expert_lora_targets(model, targets, linear_names: list[str]):
    """(target_modules, target_parameters) for peft's LoraConfig. A dense model: `targets` as given and None.
    A mixture of fused experts: the linear layers `targets` asks for (`linear_names`: all the model's, by short
    name) without the expert parts, and the fused expert parameters it asks for."""
    experts = fused_expert_parameters(model)
    if not experts:
        return targets, None
    if targets == "all-linear":
        modules = [n for n in linear_names if n not in EXPERT_PARTS and n not in ROUTERS]
        return (modules or None), experts
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    routers = sorted(leaves & set(ROUTERS))
    if routers:
        raise ConfigError(f"--lora_target_modules {','.join(routers)}: LoRA on a mixture of experts' router is not "
                          "supported (vLLM's LoRA is not checked on it); adapt the experts and attention instead")
    wanted = {EXPERT_PARTS[leaf] for leaf in leaves if leaf in EXPERT_PARTS}
    params = [e for e in experts if ALL_EXPERTS in leaves or e.rsplit(".", 1)[-1] in wanted]
    modules = [t for t in targets if t.rsplit(".", 1)[-1] not in EXPERT_PARTS and t != ALL_EXPERTS]
    return (modules or None), (params or None)

