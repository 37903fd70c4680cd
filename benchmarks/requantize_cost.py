"""What qlora's default base costs at load: each 4-bit weight quantized again from the checkpoint in blocks of 32
with searched scales (--qlora_block_size 32 --qlora_block_scale mse), against bitsandbytes' stock base.

1. A real model (default: the embedded SmolLM2-135M-Instruct): load_policy's seconds with the stock base and with
   the default one, on the GPU when there is one, after one untimed load (start-up, the page cache).
2. A large model's shapes, with random weights (no checkpoint needed): seconds to search the scales and quantize
   every linear weight of one decoder layer, times the number of layers. Reading the checkpoint again is not in it.

    python benchmarks/requantize_cost.py                       # SmolLM2-135M, then Llama-3-8B's shapes (GPU)
    python benchmarks/requantize_cost.py --model <folder> --shapes none
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

# (out, in) of each linear weight of one decoder layer, and the number of layers
SHAPES = {"llama3-8b": ([(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                         (4096, 14336)], 32),
          "qwen2.5-1.5b": ([(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536),
                            (1536, 8960)], 28)}


def synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def load_seconds(model: str, device: torch.device, dtype: torch.dtype) -> dict:
    from grpo.config.options import (BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE, DEFAULT_BLOCK_SCALE,
                             DEFAULT_BLOCK_SIZE, GRPOConfig)
    from grpo.model.embedded import resolve_model_path
    from grpo.model.loading import load_policy

    path = resolve_model_path(model)
    seconds = {}
    stock = dict(qlora_block_size=BITSANDBYTES_BLOCK_SIZE, qlora_block_scale=BITSANDBYTES_BLOCK_SCALE)
    load_policy(GRPOConfig(model_name_or_path=path, tuning_strategy="qlora", **stock), path, dtype, device)  # warm-up
    for name, options in [(f"stock ({BITSANDBYTES_BLOCK_SIZE}, {BITSANDBYTES_BLOCK_SCALE})", stock),
                          (f"default ({DEFAULT_BLOCK_SIZE}, {DEFAULT_BLOCK_SCALE})", {})]:
        config = GRPOConfig(model_name_or_path=path, tuning_strategy="qlora", **options)
        start = synchronized(device)
        policy = load_policy(config, path, dtype, device)
        seconds[name] = synchronized(device) - start
        del policy
    return seconds


def layer_seconds(shapes, device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(stock quantization, search + quantization) seconds for one layer's weights, after one warm-up layer."""
    import bitsandbytes.functional as bnbf

    from grpo.model.qlora_rounding import codebook, mse_block_rounding

    weights = [torch.randn(shape, device=device, dtype=dtype) * 0.02 for shape in shapes]
    codes = codebook("nf4")
    timings = []
    for _ in range(2):  # the first pass warms up the kernels
        start = synchronized(device)
        for weight in weights:
            bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
        stock = synchronized(device) - start
        for weight in weights:
            rounded = mse_block_rounding(weight, codes, 32).to(dtype)
            bnbf.quantize_4bit(rounded, blocksize=32, quant_type="nf4", compress_statistics=True)
        timings.append((stock, synchronized(device) - start - stock))
    return timings[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shapes", default=None, choices=[*SHAPES, "none"],
                        help="default: llama3-8b on a GPU, none on a CPU (there it would take many minutes)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # bf16 is slow on CPU
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    if args.model != "none":
        for name, seconds in load_seconds(args.model, device, dtype).items():
            print(f"{args.model}: load_policy, qlora base {name}: {seconds:.1f} s on {where}")
    shapes_name = args.shapes or ("llama3-8b" if device.type == "cuda" else "none")
    if shapes_name != "none":
        shapes, layers = SHAPES[shapes_name]
        stock, searched = layer_seconds(shapes, device, dtype)
        print(f"{shapes_name} shapes, random weights, {layers} layers on {where}: stock quantization "
              f"{stock * layers:.2f} s, blocks of 32 with searched scales {searched * layers:.2f} s "
              f"({searched * 1000:.0f} ms a layer)")


if __name__ == "__main__":
    main()
