"""Which rewards a base earns before any training step: on a dataset's training prompts (`arith` unless --dataset names
another registry entry), the policy grpo would train
(full precision, or a 4-bit QLoRA base) samples k completions per prompt as step 1 does (temperature 1, HF engine),
and the dataset's own reward functions score them.

Per variant: the mean of each reward function, the share of completions that box an answer, that box 3 or more
times, that hit the token cap, and the mean length. GRPO first reinforces whichever reward the base already earns
most often; a base that boxes from the start is pulled to the format reward before the number reward.

    python benchmarks/base_rewards.py                   # full vs qlora (bitsandbytes' stock nf4 base), 16 prompts x 8
    python benchmarks/base_rewards.py --variants full qlora/32=mse     # qlora's default base (quantized_arithmetic.py)
    python benchmarks/base_rewards.py --variants full qlora qlora@fp4 --prompts 32 --seeds 0 1
    python benchmarks/base_rewards.py --dataset gsm8k --max_new_tokens 256 --max_prompt_length 272 \
        --variants full qlora/32=mse qlora                # GSM8K (data/gsm8k/train.jsonl, as the registry says)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from quantized_arithmetic import variant_trainers  # noqa: E402  (policies as GRPOTrainer builds them)


def sample_and_score(trainer, prompts: int, k: int, max_new_tokens: int, seed: int) -> dict:
    from grpo.rollout.engine import SamplingSettings

    torch.manual_seed(seed)
    rows = [trainer.train_set[i] for i in range(prompts)]
    sampling = SamplingSettings(n=k, max_new_tokens=max_new_tokens, logprobs=False)
    completions = trainer.rollout_engine.generate([r["prompt_ids"] for r in rows], sampling)
    texts = trainer.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    per_completion = [r for r in rows for _ in range(k)]  # completions come grouped by prompt
    result = trainer.rewards(texts, [r["answer"] for r in per_completion],
                             [r["data_source"] for r in per_completion],
                             prompts=[r["prompt_text"] for r in per_completion],
                             completion_ids=[c.token_ids for c in completions])
    boxes = [t.count("\\boxed{") for t in texts]
    n = len(texts)
    return {"completions": n, "reward": sum(result.total) / n, **{f"r_{k}": v for k, v in result.means().items()},
            "boxed": sum(b >= 1 for b in boxes) / n, "boxed_3plus": sum(b >= 3 for b in boxes) / n,
            "capped": sum(c.finish_reason == "length" for c in completions) / n,
            "length": sum(len(c.token_ids) for c in completions) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["full", "qlora"],
                        help='as in quantized_arithmetic.py: full, qlora, "qlora@fp4", "qlora/32", '
                             '"qlora:<modules kept>"')
    parser.add_argument("--prompts", type=int, default=16, help="training prompts (the first ones of the split)")
    parser.add_argument("--k", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--max_prompt_length", type=int, default=128)
    parser.add_argument("--dataset", default="arith", help="a name in --dataset_config_path")
    parser.add_argument("--dataset_config_path", default=None, help="default: the shipped configs/dataset_config.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    data = dict(dataset_names=[args.dataset], max_prompt_length=args.max_prompt_length,
                max_seq_length=args.max_prompt_length + args.max_new_tokens, rollout_max_new_tokens=args.max_new_tokens,
                **({"dataset_config_path": args.dataset_config_path} if args.dataset_config_path else {}))
    results = []
    for variant, trainer, start in variant_trainers(args.model, args.variants, 1, **data):
        for seed in args.seeds:
            results.append({"variant": variant, "seed": seed,
                            **sample_and_score(trainer, args.prompts, args.k, args.max_new_tokens, seed),
                            "seconds": round(time.perf_counter() - start, 1)})
            print(json.dumps(results[-1]), flush=True)
        del trainer
    rewards = [k for k in results[0] if k.startswith("r_")]  # the dataset's own reward functions
    print(f"\n| variant | seed | completions | mean reward | {' | '.join(k[2:] for k in rewards)} | boxed | "
          f"boxed 3+ times | at the cap | length |\n|{'---|' * (len(rewards) + 8)}")
    for r in results:
        print(f"| {r['variant']} | {r['seed']} | {r['completions']} | {r['reward']:.3f} | "
              + "".join(f"{r.get(k, float('nan')):.3f} | " for k in rewards)
              + f"{r['boxed']:.2f} | {r['boxed_3plus']:.2f} | {r['capped']:.2f} | {r['length']:.1f} |")


if __name__ == "__main__":
    main()
