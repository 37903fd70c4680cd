"""QLoRA with the 4-bit rounding error corrected at rank r (LoftQ, one pass), so training starts near the 16-bit model.

Plain QLoRA trains on dequantize(Q), which for a small model is far from the checkpoint (SmolLM2-135M: 0.66
nats/token mean KL on arith chat text). Following LoftQ (Li et al., 2023), the best rank-r approximation of the
rounding error is added back:

    R = W - dequantize(Q)              (W from the checkpoint, Q the nf4 weight being trained on)
    R ~= U_r S_r V_r^T                 (truncated SVD, r = --lora_rank)
    A = S_r^1/2 V_r^T,  B = U_r S_r^1/2 / s        with s = alpha / r
    policy weight = dequantize(Q) + s B A + s B' A'      (B' A': the trained adapter, B' = 0 at the start)

The correction lives in a second, frozen LoRA adapter (CORRECTION_ADAPTER) that is always active next to the trained
one. So the trained adapter starts at zero exactly as in plain QLoRA and takes steps of the same size (LoftQ's own
recipe trains the correction itself, which starts both factors away from zero and enlarges every step), and:
  - weight sync merges both adapters (grpo/sync.py sums the active ones);
  - the KL penalty's reference is the starting policy, dequantize(Q) + s B A (grpo.model.loading.reference_mode);
  - the saved adapter is the two concatenated into one rank-2r LoRA for the 4-bit base (save_combined_adapter).
The 4-bit weight itself is kept (peft's multi-pass LoftQ re-quantizes W - sBA; bitsandbytes' quantization is fixed
once the model is loaded).
"""
from __future__ import annotations

import logging
import os

import torch

from grpo.model.base_weights import CheckpointWeights
from grpo.errors import ConfigError
from grpo.model.layer_weights import checkpoint_name, dense_weight, is_4bit
from grpo.model.vision import checkpoint_prefixes, rename

logger = logging.getLogger(__name__)

CORRECTION_ADAPTER = "loftq_correction"


def low_rank_factors(residual: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) with scale * B @ A the best rank-r approximation of `residual` [out, in]."""
    u, s, vh = torch.linalg.svd(residual.float(), full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root / scale


@torch.no_grad()
def init_adapter_from_rounding_error(model, model_path: str, adapter: str = "default") -> float:
    """Set every 4-bit LoRA layer's A, B as above. Returns the share of the rounding error's energy (squared
    Frobenius norm, summed over layers) that the adapters now cancel."""
    from peft.tuners.lora import LoraLayer

    prefixes = checkpoint_prefixes(model)
    layers, captured, total = 0, 0.0, 0.0
    with CheckpointWeights(model_path, "--qlora_init loftq") as checkpoint:
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            base = module.get_base_layer()
            if not is_4bit(base.weight):
                continue  # a layer kept in 16 bits (--qlora_skip_modules) has no rounding error
            name = rename(checkpoint_name(module_name), prefixes) + ".weight"
            rounded = dense_weight(base)                     # dequantize(Q), fp32, on the layer's device
            residual = checkpoint.read(name, module_name, base).to(rounded.device, torch.float32) - rounded
            lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            rank = lora_a.shape[0]
            a, b = low_rank_factors(residual, rank, module.scaling[adapter])
            lora_a.copy_(a.to(lora_a.dtype))
            lora_b.copy_(b.to(lora_b.dtype))
            kept = (module.scaling[adapter] * (lora_b.float() @ lora_a.float()) - residual).pow(2).sum().item()
            energy = residual.pow(2).sum().item()
            captured += energy - kept
            total += energy
            layers += 1
    if layers == 0:
        raise ConfigError("--qlora_init loftq found no 4-bit layer with a LoRA adapter; it applies to "
                          "--tuning_strategy qlora with LoRA on the quantized layers")
    share = captured / max(total, 1e-30)
    logger.info(f"qlora init loftq: a frozen rank-{rank} correction on {layers} 4-bit layers (it cancels "
                f"{100 * share:.1f}% of the rounding error's energy)")
    return share


@torch.no_grad()
def round_like_training(base, trained) -> int:
    """Replace, in a full-precision copy `base` of the model, each weight that is 4-bit in `trained` (the peft
    model) by that 4-bit weight dequantized, however it was rounded (block size, block scale): a loftq adapter merged
    into that copy gives the policy as trained. Returns the number of weights rounded."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    live = dict(base.named_parameters())
    rounded = 0
    for module_name, module in trained.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):  # the 4-bit layer itself, not peft's wrapper around it
            continue
        weight = module.weight
        name = checkpoint_name(module_name) + ".weight"
        if name not in live:
            raise ConfigError(f"merging the loftq adapter: the base model has no weight {name!r}")
        target = live[name]
        target.data.copy_(bnbf.dequantize_4bit(weight.data, weight.quant_state).to(target.device, target.dtype))
        rounded += 1
    return rounded


def add_rounding_correction(model, model_path: str, trained: str = "default") -> float:
    """Add the frozen rank-r correction of the 4-bit rounding error as an adapter active next to `trained`.
    Returns the share of the rounding error's energy it cancels."""
    import copy

    config = copy.deepcopy(model.peft_config[trained])
    config.lora_dropout = 0.0  # a fixed part of the base: no dropout on it in training mode
    model.add_adapter(CORRECTION_ADAPTER, config)
    share = init_adapter_from_rounding_error(model, model_path, CORRECTION_ADAPTER)
    model.base_model.set_adapter([trained, CORRECTION_ADAPTER])
    freeze_correction(model)
    return share


def freeze_correction(model) -> None:
    """peft marks every active adapter trainable whenever the active set changes: the correction stays frozen."""
    for name, param in model.named_parameters():
        if f".{CORRECTION_ADAPTER}." in name:
            param.requires_grad_(False)


def save_combined_adapter(model, path: str, state_dict=None, trained: str = "default") -> None:
    """Save the trained adapter and the correction as one plain rank-2r LoRA: on the 4-bit base,
    s [B' B] [A'; A] = s B' A' + s B A is the policy as trained (alpha doubles with r, so s = alpha / r stays)."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    parts = [get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=a)
             for a in (trained, CORRECTION_ADAPTER)]
    combined = {}
    for key, value in parts[0].items():
        if "lora_A" in key:
            combined[key] = torch.cat([value, parts[1][key]], dim=0)   # [2r, in]
        elif "lora_B" in key:
            combined[key] = torch.cat([value, parts[1][key]], dim=1)   # [out, 2r]
        else:
            raise ConfigError(f"--qlora_init loftq saves plain LoRA factors only; the adapter has {key!r}")
    config = copy.deepcopy(model.peft_config[trained])
    config.r, config.lora_alpha = 2 * config.r, 2 * config.lora_alpha
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in combined.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
