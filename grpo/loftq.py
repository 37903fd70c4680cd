"""QLoRA adapter initialised from the 4-bit rounding error (LoftQ, one pass), so training starts near the 16-bit model.

Plain QLoRA starts from B = 0: the policy is dequantize(Q), which for a small model is far from the checkpoint
(SmolLM2-135M: 0.66 nats/token mean KL on arith chat text). LoftQ (Li et al., 2023) sets the adapter to the best
rank-r approximation of the rounding error instead:

    R = W - dequantize(Q)              (W from the checkpoint, Q the nf4 weight being trained on)
    R ~= U_r S_r V_r^T                 (truncated SVD, r = --lora_rank)
    A = S_r^1/2 V_r^T,  B = U_r S_r^1/2 / s        with s = alpha / r, the adapter's scale
    policy weight = dequantize(Q) + s B A = dequantize(Q) + U_r S_r V_r^T

With the KL penalty, the reference is the policy training starts from: a frozen copy of the initial adapter,
named REFERENCE_ADAPTER (grpo.models.reference_mode switches to it), not the 4-bit base with the adapter off.

The 4-bit weight itself is kept (peft's multi-pass LoftQ re-quantizes W - sBA; bitsandbytes' quantization is fixed
once the model is loaded), so this is the single pass that works on a model already quantized by bitsandbytes.
"""
from __future__ import annotations

import glob
import json
import logging
import os

import torch

from .errors import ConfigError
from .sync import checkpoint_name, dense_weight, is_4bit
from .vision import checkpoint_prefixes, rename

logger = logging.getLogger(__name__)

REFERENCE_ADAPTER = "reference"


def low_rank_factors(residual: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B [out, r]) with scale * B @ A the best rank-r approximation of `residual` [out, in]."""
    u, s, vh = torch.linalg.svd(residual.float(), full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root / scale


def checkpoint_tensors(model_path: str) -> dict[str, tuple[str, str]]:
    """Checkpoint weight name -> (safetensors file, name) for a local model folder."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        return {name: (os.path.join(model_path, file), name) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ConfigError(f"--qlora_init loftq reads the 16-bit weights from the checkpoint's .safetensors files; "
                          f"{model_path} has none (use --qlora_init zero, or a checkpoint saved with safetensors)")
    from safetensors import safe_open

    found = {}
    for file in files:
        with safe_open(file, framework="pt") as fh:
            found.update({name: (file, name) for name in fh.keys()})
    return found


@torch.no_grad()
def init_adapter_from_rounding_error(model, model_path: str, adapter: str = "default") -> float:
    """Set every 4-bit LoRA layer's A, B as above. Returns the share of the rounding error's energy (squared
    Frobenius norm, summed over layers) that the adapters now cancel."""
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open


    tensors = checkpoint_tensors(model_path)
    prefixes = checkpoint_prefixes(model)
    handles = {}
    layers, captured, total = 0, 0.0, 0.0
    try:
        for module_name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            base = module.get_base_layer()
            if not is_4bit(base.weight):
                continue  # a layer kept in 16 bits (--qlora_skip_modules) has no rounding error
            name = rename(checkpoint_name(module_name), prefixes) + ".weight"
            if name not in tensors:
                raise ConfigError(f"--qlora_init loftq: the checkpoint in {model_path} has no weight {name!r} for "
                                  f"layer {module_name} (use --qlora_init zero)")
            file, key = tensors[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            rounded = dense_weight(base)                     # dequantize(Q), fp32, on the layer's device
            residual = handles[file].get_tensor(key).to(rounded.device, torch.float32) - rounded
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
    finally:
        handles.clear()
    if layers == 0:
        raise ConfigError("--qlora_init loftq found no 4-bit layer with a LoRA adapter; it applies to "
                          "--tuning_strategy qlora with LoRA on the quantized layers")
    share = captured / max(total, 1e-30)
    logger.info(f"qlora init loftq: {layers} adapters set from the 4-bit rounding error (they cancel "
                f"{100 * share:.1f}% of its energy)")
    return share


@torch.no_grad()
def round_like_training(base, trained) -> int:
    """Replace, in a full-precision copy `base` of the model, each weight that is 4-bit in `trained` (the peft
    model) by dequantize(nf4(weight)), as bitsandbytes rounded it on loading: a loftq adapter merged into that copy
    gives the policy as trained. Returns the number of weights rounded."""
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
        state = weight.quant_state
        target = live[name]
        q, qs = bnbf.quantize_4bit(target.data.to(state.dtype), blocksize=state.blocksize, quant_type=state.quant_type,
                                   compress_statistics=state.nested)
        target.data.copy_(bnbf.dequantize_4bit(q, qs).to(target.dtype))
        rounded += 1
    return rounded


@torch.no_grad()
def add_reference_adapter(model, adapter: str = "default") -> None:
    """A frozen copy of `adapter` under REFERENCE_ADAPTER: the starting policy, for the KL penalty's reference."""
    model.add_adapter(REFERENCE_ADAPTER, model.peft_config[adapter])  # inactive, so not trainable
    params = dict(model.named_parameters())
    copied = 0
    for name, param in params.items():
        if f".{REFERENCE_ADAPTER}." in name:
            param.copy_(params[name.replace(f".{REFERENCE_ADAPTER}.", f".{adapter}.")])
            param.requires_grad_(False)
            copied += 1
    logger.info(f"KL reference: the initial loftq adapter, kept frozen ({copied} tensors)")
