"""Seconds per optimizer step of TRL's GRPOTrainer on the work of grpo's throughput run (GPU only, never run by CI).

The work, as in benchmarks/throughput.sh's grpo run: the `arith` prompts rendered as grpo renders them (the
registry's system prompt and template, the tokenizer's chat template), --prompts prompts x --k samples per
optimizer step, at most --max_new new tokens, LoRA r16 alpha 32 dropout 0.05 on all linear layers, lr 1e-5, bf16
weights, vLLM colocated (--vllm_mem of the GPU), no KL term (beta 0, no reference model), one update per rollout,
no gradient checkpointing (grpo's default; TRL's is on). TRL's importance-sampling correction of vLLM's log-probs
(on by default in TRL, an extra log-prob pass over the batch) is off unless --is_correction, as grpo's colocate
default is. The reward: 1 for a \\boxed{} holding the answer, else 0.

One step = --micro completions per micro-batch x (prompts x k / micro) accumulation steps; TRL generates the whole
step's prompts x k completions at once (generation_batch_size), then trains on them. Seconds per step = time
between consecutive on_step_end callbacks (TRL's per-step logging included), the first step left out.

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/trl_step.py --model /tmp/llama068 \\
        --output_dir /tmp/trl --steps 6 --json /tmp/trl/trl.json

Reasoning lengths, as benchmarks/memory_scale.sh runs grpo (4 prompts x 8 x 3840 new tokens, qlora nf4 with double
quantization, TRL's gradient checkpointing on, its vLLM asleep while training); the row has the step's peak GPU memory
(torch's allocator, this process: TRL's colocated vLLM included) or "oom" and where it struck:

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/trl_step.py --model /tmp/qwen7b \\
        --output_dir /tmp/trl4k --steps 2 --prompts 4 --max_new 3840 --max_model_len 4096 --micro 2 --qlora \\
        --gradient_checkpointing --vllm_sleep --json /tmp/trl4k/trl.json

Checked against trl 1.16.0 (trl/trainer/grpo_config.py, grpo_trainer.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arith_prompts(registry_path: str, name: str = "arith") -> list[dict]:
    """The registry entry's rows as chat prompts: system prompt, then the template around the question."""
    spec = json.load(open(registry_path))[name]
    path = os.path.join(os.path.dirname(os.path.abspath(registry_path)), spec["path"])
    rows = []
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            question = spec["prompt_template"].replace("{prompt}", row[spec["prompt_field"]])
            rows.append({"prompt": [{"role": "system", "content": spec["system_prompt"]},
                                    {"role": "user", "content": question}],
                         "answer": str(row[spec["answer_field"]])})
    return rows


def boxed_answer(completions, answer, **_) -> list[float]:
    """1.0 when the last \\boxed{...} of the completion is the answer."""
    scores = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # chat or plain
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
        scores.append(1.0 if boxed and boxed[-1].strip() == gold.strip() else 0.0)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--json", required=True, help="write the result row here")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--max_new", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=384, help="vLLM context (grpo: --max_seq_length)")
    parser.add_argument("--micro", type=int, default=32, help="completions per micro-batch")
    parser.add_argument("--vllm_mem", type=float, default=0.3)
    parser.add_argument("--vllm_sleep", action="store_true", help="TRL's vllm_enable_sleep_mode (level 2)")
    parser.add_argument("--is_correction", action="store_true", help="TRL's vLLM importance-sampling correction")
    parser.add_argument("--qlora", action="store_true", help="load the model in 4 bits (nf4, double quantization)")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="TRL's default (grpo's: auto)")
    parser.add_argument("--registry", default=os.path.join(ROOT, "configs", "dataset_config.json"))
    args = parser.parse_args()
    completions = args.prompts * args.k
    if completions % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide {completions} completions per step")

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    import torch

    model_init = {"dtype": "bfloat16"}
    if args.qlora:
        from transformers import BitsAndBytesConfig

        model_init["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=1e-5, lr_scheduler_type="constant",
        bf16=True, model_init_kwargs=model_init, gradient_checkpointing=args.gradient_checkpointing,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=completions // args.micro,
        num_generations=args.k, max_completion_length=args.max_new, temperature=1.0,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_mem,
        vllm_max_model_length=args.max_model_len, vllm_enable_sleep_mode=args.vllm_sleep,
        vllm_importance_sampling_correction=args.is_correction, beta=0.0, num_iterations=1,
        logging_steps=1, report_to="none", save_strategy="no", seed=42)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=[boxed_answer], args=config,
        train_dataset=Dataset.from_list(arith_prompts(args.registry)), callbacks=[clock],
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                               task_type="CAUSAL_LM"))
    start = time.perf_counter()
    failure = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:  # the figure this benchmark reports at long lengths
        failure = f"oom after {len(clock.marks) - 1} steps: {str(error).splitlines()[0][:200]}"
    wall = time.perf_counter() - start
    steps = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    measured = steps[1:]
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    row = {"framework": "trl", "steps": len(steps), "step_seconds": steps,
           "s_per_step": statistics.mean(measured) if measured else None,
           "completion_length_mean": statistics.mean(lengths[1:] or lengths) if lengths else None,
           "samples_per_step": completions, "train_wall_s": wall, "micro_batch": args.micro,
           "grad_accum": completions // args.micro, "vllm_sleep": args.vllm_sleep,
           "is_correction": args.is_correction, "qlora": args.qlora,
           "gradient_checkpointing": args.gradient_checkpointing, "max_new": args.max_new,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "failure": failure}
    with open(args.json, "w") as fh:
        json.dump(row, fh, indent=1)
    print(json.dumps({k: v for k, v in row.items() if k != "step_seconds"}), flush=True)
    os._exit(0)  # skip the interpreter's teardown, where an in-process vLLM engine can hang


if __name__ == "__main__":
    main()
