"""Write a copy of a model whose linear weights (all but the output layer) are rounded through bitsandbytes' 4-bit
format and back, in 16 bits: the base QLoRA trains on, as an ordinary checkpoint (--rounding nf4/32/mse: qlora's
default base; nf4/64: bitsandbytes' stock one, --qlora_block_size 64 --qlora_block_scale absmax).

LoRA on this copy sees the same base weights as QLoRA on the original (bitsandbytes dequantizes the 4-bit weight to
exactly these values before each matmul), but trains through the ordinary 16-bit path. Comparing the two separates
what the 4-bit rounding costs from what QLoRA's training path (4-bit layers, k-bit preparation) costs:

    python benchmarks/rounded_checkpoint.py --rounding nf4/64 --out outputs/smollm2-nf4-64
    MODEL=outputs/smollm2-nf4-64 ARITH=lora TAG=on-nf4 GSM8K= bash benchmarks/learning.sh

Rounded where bitsandbytes would round in training: on the GPU when there is one, in --dtype (bf16 as on a GPU).
For text models: a vision-language model's vision tower, which QLoRA keeps in 16 bits, would be rounded too.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the embedded alias or a local folder")
    parser.add_argument("--rounding", default="nf4/64",
                        help='"<nf4|fp4>/<weights per scale>[/nodq][/mse]" (nodq: scales kept in 32 bits; mse: '
                             'scales as --qlora_block_scale mse picks them)')
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", required=True, help="folder for the rounded checkpoint (safetensors + tokenizer)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.quantized_arithmetic import round_linear_layers
    from grpo.model.embedded import resolve_model_path

    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    if torch.cuda.is_available():
        model.cuda()
    relative_error = round_linear_layers(model, args.rounding)
    model.cpu().save_pretrained(args.out)
    AutoTokenizer.from_pretrained(path).save_pretrained(args.out)
    print(f"{args.out}: linear weights rounded as {args.rounding} in {args.dtype} "
          f"(relative error {relative_error:.4f})")


if __name__ == "__main__":
    main()
