"""Write a model's 4-bit-rounded weights (nf4, or fp4 as --qlora_quant_type fp4 uses) as a plain bf16 checkpoint:
LoRA on it sees exactly the base QLoRA sees on bitsandbytes' stock rounding (--qlora_block_size 64
--qlora_block_scale absmax; benchmarks/rounded_checkpoint.py --rounding nf4/32/mse writes qlora's default), so a
difference between `lora` on this folder and `qlora` on the original lies in the QLoRA training path, and none
between them puts it in the 4-bit rounding of the base.

    python benchmarks/nf4_base.py --model smollm2-135m-instruct --out /tmp/nf4_base
    python benchmarks/nf4_base.py --quant_type fp4 --out /tmp/fp4_base
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quant_type", choices=("nf4", "fp4"), default="nf4", help="the 4-bit data type")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from grpo.model.embedded import resolve_model_path
    from grpo.sync.weight_sync import iter_policy_weights

    path = resolve_model_path(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant_type,
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    quantized = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit, device_map={"": device})
    rounded = dict(iter_policy_weights(quantized, "qlora", dtype=dtype, first_sync=True))  # every 4-bit linear
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    missing = set(rounded) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict({k: v.cpu() for k, v in rounded.items()}, strict=False)
    model.save_pretrained(args.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(path).save_pretrained(args.out)
    print(f"{len(rounded)} linear weights replaced by their {args.quant_type} rounding -> {args.out}")


if __name__ == "__main__":
    main()
