"""--qlora_block_size: QLoRA's frozen 4-bit base with one scale per `block_size` weights instead of bitsandbytes' 64.

Each block of weights is stored as 4-bit codes times the block's largest magnitude, so a smaller block follows the
weights more closely: on SmolLM2-135M, nf4 in blocks of 64 keeps 0.14 of the 16-bit model's 0.23 greedy arithmetic
and blocks of 32 keep 0.18 (benchmarks/quantized_arithmetic.py --rounding). The cost is one more (double-quantized,
8-bit) scale per block: about 4.25 bits per weight at 32 against 4.13 at 64.

transformers' BitsAndBytesConfig has no block size, so the model is loaded with bitsandbytes' 64 and each 4-bit weight
is quantized again from the checkpoint's 16-bit weight W (quantizing the dequantized 64-block weight would round twice):

    Q = quantize_4bit(W, blocksize=block_size)      in the dtype the model was loaded in, on the layer's device
"""
from __future__ import annotations

import logging

import torch

from .checkpoint_weights import CheckpointWeights
from .config import BITSANDBYTES_BLOCK_SIZE
from .sync import checkpoint_name
from .vision import checkpoint_prefixes, rename

logger = logging.getLogger(__name__)


@torch.no_grad()
def requantize_4bit_base(model, model_path: str, block_size: int) -> int:
    """Quantize every 4-bit linear weight of a freshly loaded (not yet peft-wrapped) model again from the checkpoint,
    in blocks of `block_size`. Returns the number of weights quantized."""
    import bitsandbytes as bnb

    prefixes = checkpoint_prefixes(model)
    layers = 0
    with CheckpointWeights(model_path, f"--qlora_block_size {block_size}") as checkpoint:
        for module_name, module in model.named_modules():
            if not isinstance(module, bnb.nn.Linear4bit):
                continue
            loaded = module.weight
            name = rename(checkpoint_name(module_name), prefixes) + ".weight"
            weight = checkpoint.read(name, module_name, module).to(loaded.quant_state.dtype)
            # .to(device) quantizes (Params4bit._quantize) and points module.quant_state at the new state
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, blocksize=block_size,
                                              compress_statistics=loaded.compress_statistics,
                                              quant_type=loaded.quant_type, quant_storage=loaded.quant_storage,
                                              module=module).to(loaded.device)
            layers += 1
    logger.info(f"qlora: {layers} 4-bit weights quantized in blocks of {block_size} (bitsandbytes' default: "
                f"{BITSANDBYTES_BLOCK_SIZE})")
    return layers
