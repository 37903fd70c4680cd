"""One GPU check, in its own process: right after GRPOTrainer is built (before any step), the vLLM engine scores
like the policy being trained (for qlora: the 4-bit policy, not the bf16 checkpoint vLLM loaded), and evaluate()
runs on it.

    python tests/gpu/trainer_start_check.py --strategy qlora --out result.json

Records, as mean |log-prob difference| over a fixed chat sequence of the embedded SmolLM2:
  engine_vs_policy      the engine after construction vs the trainer's policy
  checkpoint_vs_policy  the bf16 checkpoint on disk (what vLLM loaded) vs the policy (large for qlora only)
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402
from qlora_rounding_args import add_qlora_rounding_args, qlora_rounding  # noqa: E402  (beside this script)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["full", "lora", "qlora"], required=True)
    add_qlora_rounding_args(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from grpo.algorithm import token_logprobs
    from grpo.config.options import GRPOConfig
    from grpo.train.trainer import GRPOTrainer

    config = GRPOConfig(tuning_strategy=args.strategy, dataset_names=["arith"], rollout_engine="vllm",
                        vllm_enforce_eager=True, lora_dropout=0.0, max_steps=1, eval_max_prompts=32,
                        rollout_max_new_tokens=64, max_prompt_length=128, max_seq_length=192, save_steps=0,
                        output_dir=tempfile.mkdtemp(), overwrite_output_dir=True, **qlora_rounding(args))
    trainer = GRPOTrainer(config)
    messages = [{"role": "user", "content": "What is 17 + 25? Give only the final answer in \\boxed{}."},
                {"role": "assistant", "content": "17 + 25 = 42, so the answer is \\boxed{42}."}]
    sequence = trainer.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    sequence = list(sequence["input_ids"] if isinstance(sequence, dict) else sequence)
    ids = torch.tensor([sequence], device=trainer.device)

    def logprobs_of(model):
        with torch.no_grad():
            return token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0].float().cpu()

    policy = logprobs_of(trainer.engine.module.eval())
    engine = torch.tensor(trainer.rollout_engine.prompt_logprobs(sequence))
    checkpoint_model = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.bfloat16).cuda()
    checkpoint = logprobs_of(checkpoint_model)
    del checkpoint_model
    trainer.rollout_engine.sleep(keep_weights=True)  # as after an evaluation: the next evaluate() wakes it
    metrics = trainer.evaluate()
    result = {"strategy": args.strategy, "tokens": len(sequence),
              "engine_vs_policy": (engine - policy).abs().mean().item(),
              "checkpoint_vs_policy": (checkpoint - policy).abs().mean().item(),
              "eval": metrics}
    print(json.dumps(result), flush=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
