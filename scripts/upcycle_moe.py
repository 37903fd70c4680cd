"""Upcycle a dense Llama-family model (default: the embedded SmolLM2-135M-Instruct) into a Mixtral-style mixture of
experts whose outputs equal the dense model's at the start (grpo/model/upcycle.py), and check that they do.

    python scripts/upcycle_moe.py --out /tmp/smollm2-moe --experts 4 --top_k 2
    python train_grpo.py --model_name_or_path /tmp/smollm2-moe --tuning_strategy lora ...
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a dense model folder, or the embedded alias")
    parser.add_argument("--out", required=True)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.model.embedded import resolve_model_path
    from grpo.model.upcycle import upcycle

    dense_path = resolve_model_path(args.model)
    out = upcycle(dense_path, args.out, args.experts, args.top_k, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(["What is 17 + 25? Answer:", "The capital of France is"], return_tensors="pt", padding=True)
    with torch.no_grad():
        dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)(**ids).logits
        moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(**ids).logits
    mask = ids["attention_mask"].bool()
    gap = (dense - moe).abs()[mask].max().item()
    print(f"{out}: {args.experts} experts, top-{args.top_k}; largest logit difference from the dense model "
          f"{gap:.2e} (stored in the dense model's dtype)")


if __name__ == "__main__":
    main()
