"""What the CPU tests of weight sync and of the engine's weights share: a tiny policy as if trained."""
import torch

from grpo.config.options import GRPOConfig
from grpo.model.loading import load_policy

CPU = torch.device("cpu")
STOCK_4BIT = dict(qlora_block_size=64, qlora_block_scale="absmax")  # bitsandbytes' own base, as transformers loads it
IDS = torch.tensor([[5, 7, 8, 28, 9, 29, 12]])


def as_if_trained(model):
    """Move every trainable tensor (lora_B starts at zero, so the adapter would otherwise be a no-op)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p += 0.05 * torch.randn_like(p)
    return model


def trained_policy(model_dir, strategy, targets="all-linear", exclude=None, **options):
    cfg = GRPOConfig(model_name_or_path=model_dir, tuning_strategy=strategy, lora_rank=4, lora_alpha=8,
                     lora_dropout=0.0, lora_target_modules=targets, lora_exclude_modules=exclude, **options)
    return as_if_trained(load_policy(cfg, model_dir, torch.float32, CPU))


def module_holding(tensors: dict, wrap=None) -> torch.nn.Module:
    """A module whose parameters are `tensors` under their dotted names: an engine's model, as far as the weight sync
    and base sharing see it. `wrap(tensor)` makes each parameter (default: a frozen torch Parameter)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, wrap(tensor) if wrap else torch.nn.Parameter(tensor, requires_grad=False))
    return root
