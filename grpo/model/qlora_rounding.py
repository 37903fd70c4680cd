"""--qlora_block_size / --qlora_block_scale: how QLoRA's frozen 4-bit base is rounded. The defaults, 32 and mse, keep
more of the 16-bit model than bitsandbytes' stock base (64 and absmax, which transformers loads and this leaves as is).

--qlora_block_size: one scale per `block_size` weights instead of bitsandbytes' 64.

Each block of weights is stored as 4-bit codes times the block's largest magnitude, so a smaller block follows the
weights more closely: on SmolLM2-135M, nf4 in blocks of 64 keeps 0.14 of the 16-bit model's 0.23 greedy arithmetic
and blocks of 32 keep 0.18 (benchmarks/quantized_arithmetic.py --rounding). The cost is one more (double-quantized,
8-bit) scale per block: about 4.25 bits per weight at 32 against 4.13 at 64.

transformers' BitsAndBytesConfig has no block size, so the model is loaded with bitsandbytes' 64 and each 4-bit weight
is quantized again from the checkpoint's 16-bit weight W (quantizing the dequantized 64-block weight would round twice):

    Q = quantize_4bit(W, blocksize=block_size)      in the dtype the model was loaded in, on the layer's device

--qlora_block_scale mse: bitsandbytes scales each block by its largest magnitude, so one large weight stretches the
16 codes over a range the others do not use. mse_block_rounding picks, per block, the scale that minimizes the
block's squared rounding error (a weight above it takes the largest code) and hands bitsandbytes the weights rounded
that way; as their largest magnitude is that scale, bitsandbytes' own quantization stores exactly those codes and
scales, and the base stays a standard 4-bit model for every kernel and for the weight sync. On SmolLM2-135M (nf4,
blocks of 32) it cuts the relative weight error from 0.089 to 0.079 (benchmarks/quantized_arithmetic.py).
"""
from __future__ import annotations

import functools
import logging

import torch

from grpo.model.base_weights import CheckpointWeights
from grpo.config.options import BITSANDBYTES_BLOCK_SIZE
from grpo.model.layer_weights import checkpoint_name
from grpo.model.vision import checkpoint_prefixes, rename

logger = logging.getLogger(__name__)
SCALE_NAMES = {"absmax": "its largest magnitude", "mse": "the scale of least squared rounding error"}


# the scales tried per block, as fractions of its largest magnitude (measured on SmolLM2-135M: the best lie in 0.85-1)
SCALE_FRACTIONS = torch.linspace(0.5, 1.0, 51)


@functools.lru_cache  # asked once per 4-bit layer; callers only read it
def codebook(quant_type: str) -> torch.Tensor:
    """bitsandbytes' 16 code values of a 4-bit data type, sorted, the largest magnitude 1."""
    import bitsandbytes.functional as bnbf

    values = bnbf.get_4bit_type(quant_type, device="cpu").float().sort().values
    return values / values.abs().max()


@torch.no_grad()
def round_4bit(weight: torch.Tensor, quant_type: str, blocksize: int, double_quant: bool,
               dtype: torch.dtype = None) -> torch.Tensor:
    """dequantize(quantize(weight)): the weight as bitsandbytes stores it in 4 bits (quantized in `dtype`), in the
    weight's own dtype."""
    import bitsandbytes.functional as bnbf

    q, qs = bnbf.quantize_4bit(weight.to(dtype or weight.dtype), blocksize=blocksize, quant_type=quant_type,
                               compress_statistics=double_quant)
    return bnbf.dequantize_4bit(q, qs).to(weight.dtype)


@torch.no_grad()
def mse_block_rounding(weight: torch.Tensor, codes: torch.Tensor, block_size: int,
                       fractions: torch.Tensor = SCALE_FRACTIONS, chunk: int = 2 ** 22) -> torch.Tensor:
    """Each block w (`block_size` consecutive weights of the flattened tensor) rounded to s * c, in fp32:

        s = argmin over s = f * max|w|, f in `fractions` (all <= 1), of  sum_i (s * c(w_i / s) - w_i)^2
        c(x) = the code nearest to x clamped to [-1, 1]

    The largest magnitude of the result is s (the block's largest weight takes the code +-1), so bitsandbytes'
    absmax quantization of it stores these codes and s, which absmax rounding (f = 1 only) would not. Blocks are
    searched `chunk` weights at a time: the scratch memory is a few times `chunk` weights, whatever the layer's size."""
    flat = weight.detach().reshape(-1)
    # a short last block, as bitsandbytes allows, padded with zeros: they take the code 0 exactly (every 4-bit type
    # has it) and leave the block's largest magnitude as it is, so its search is unchanged
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).reshape(-1, block_size)
    rows, codes = max(1, chunk // block_size), codes.to(blocks.device)
    rounded = [_mse_rounded(blocks[i:i + rows].float(), codes, fractions) for i in range(0, blocks.shape[0], rows)]
    return torch.cat(rounded).reshape(-1)[:flat.numel()].reshape(weight.shape)


def _mse_rounded(blocks: torch.Tensor, codes: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """mse_block_rounding of [n, block_size] fp32 blocks."""
    largest = blocks.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    midpoints = (codes[1:] + codes[:-1]) / 2

    def rounded(scale):
        # the nearest code's index = how many midpoints lie below x (|x| > 1 lands on an end code, as clamping to
        # [-1, 1] would); on a CPU, 15 comparisons run 3x faster than torch.bucketize's search
        x = blocks / scale
        if x.is_cuda:
            return codes[torch.bucketize(x, midpoints, out_int32=True)] * scale
        index = torch.zeros_like(x, dtype=torch.uint8)
        for midpoint in midpoints.tolist():
            index += x > midpoint
        return codes[index.long()] * scale

    best_scale, best_error = largest, torch.full_like(largest, float("inf"))
    for fraction in fractions.tolist():
        scale = largest * fraction
        error = (rounded(scale) - blocks).square().sum(1, keepdim=True)
        better = error < best_error  # ties keep the smaller scale, tried first
        best_error, best_scale = torch.where(better, error, best_error), torch.where(better, scale, best_scale)
    return rounded(best_scale)


@torch.no_grad()
def requantize_4bit_base(model, model_path: str, block_size: int, block_scale: str, options: str) -> int:
    """Quantize every 4-bit linear weight of a freshly loaded (not yet peft-wrapped) model again from the checkpoint,
    in blocks of `block_size`, each scaled by its largest magnitude ("absmax") or by mse_block_rounding's scale
    ("mse"). `options`: the options asking for it, for errors. Returns the number of weights quantized."""
    import bitsandbytes as bnb

    prefixes = checkpoint_prefixes(model)
    layers = 0
    with CheckpointWeights(model_path, options) as checkpoint:
        for module_name, module in model.named_modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            loaded = module.weight
            name = rename(checkpoint_name(module_name), prefixes) + ".weight"
            weight = checkpoint.read(name, module_name, module)
            if block_scale == "mse":
                weight = mse_block_rounding(weight.to(loaded.device), codebook(loaded.quant_type), block_size)
            weight = weight.to(loaded.quant_state.dtype)
            # .to(device) quantizes (Params4bit._quantize) and points module.quant_state at the new state
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, blocksize=block_size,
                                              compress_statistics=loaded.compress_statistics,
                                              quant_type=loaded.quant_type, quant_storage=loaded.quant_storage,
                                              module=module).to(loaded.device)
            layers += 1
    logger.info(f"qlora: {layers} 4-bit weights quantized in blocks of {block_size} (bitsandbytes' default: "
                f"{BITSANDBYTES_BLOCK_SIZE}), each scaled by {SCALE_NAMES[block_scale]}")
    return layers

