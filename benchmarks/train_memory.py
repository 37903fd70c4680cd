"""Training-phase memory and time, before/after token-budget micro-batches and chunked log-probs (GPU only).

One GRPO step's optimisation phase (forward, loss, backward, DeepSpeed ZeRO-2 update in bf16) on a random model,
16 prompts x 8 completions, 128-token prompts, completion lengths uniform in [1, MAX_NEW] (variable, as real
rollouts are). Modes:
  before   micro-batches of --rows rows padded to the whole step's widths, full logits (the code before issue 11)
  after    --max_tokens_per_micro_batch / --logprob_chunk_tokens defaults (token budget, chunked output layer)
  packed   after + --padding_free
  after-cudnn  after, with PyTorch's cuDNN SDPA backend allowed (grpo leaves it out: a plan per new shape)
Prints one markdown row per (model, strategy, mode): peak GPU memory (max_memory_allocated) and seconds per step
(mean of --steps after one warm-up). An out-of-memory is reported as OOM. Never run by CI.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

# random models of these shapes; max_position_embeddings as the shape's instruct checkpoint has it (Qwen2.5-*-Instruct:
# 32768), which is the longest sequence vLLM serves it at
SHAPES = {
    "llama-0.68b": dict(arch="llama", max_position_embeddings=4096, vocab_size=49152, hidden_size=1536, intermediate_size=4096,
                        num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8,
                        tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(arch="qwen2", max_position_embeddings=32768, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(arch="qwen2", max_position_embeddings=32768, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False),
    "qwen2.5-14b": dict(arch="qwen2", max_position_embeddings=32768, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        tie_word_embeddings=False),
    "qwen2.5-32b": dict(arch="qwen2", max_position_embeddings=32768, vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        tie_word_embeddings=False),
}


def model_classes(shape: str, max_positions: int | None = None):
    """(config class, model class, the shape's config fields) of one of SHAPES; `max_positions` replaces its
    max_position_embeddings (a longer context than the checkpoint's, as rope scaling gives one)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    if max_positions:
        spec["max_position_embeddings"] = max_positions
    arch = spec.pop("arch")
    return (LlamaConfig, LlamaForCausalLM, spec) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM, spec)


def random_model(shape: str, device, max_positions: int | None = None, **config_kwargs):
    """A randomly initialised (seed 0) bf16 model of one of SHAPES, built on `device`."""
    config_cls, model_cls, spec = model_classes(shape, max_positions)
    config = config_cls(**config_kwargs, **spec)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 7B model in fp32 first would take 30 GB
    try:
        with torch.device(device):
            return model_cls(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)


def build_model(shape: str, strategy: str, gradient_checkpointing: bool):
    model = random_model(shape, "cuda", attn_implementation="sdpa")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if strategy == "lora":
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    return model


def make_step(vocab: int, prompts: int, k: int, prompt_len: int, max_new: int, seed: int = 0):
    from grpo.train.step_data import build_rollout_batch
    from grpo.rollout.engine import Completion

    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    completions = []
    for i in range(prompts * k):
        n = int(torch.randint(1, max_new + 1, (1,), generator=g))
        completions.append(Completion(prompt_index=i // k, token_ids=torch.randint(10, vocab, (n,), generator=g).tolist(),
                                      logprobs=[-1.0] * n, finish_reason="stop"))
    batch = build_rollout_batch(prompt_ids, completions, pad_id=0)
    return batch, torch.randn(len(completions), generator=g)


def micro_batches(batch, mode: str, cfg, rows: int):
    from grpo.train.micro_batches import MicroBatch
    from grpo.train.update import step_micro_batches

    if mode == "before":  # fixed rows, padded to the step's widths, as before
        n = len(batch.input_ids)
        return [MicroBatch(torch.arange(lo, min(lo + rows, n)), batch.rows(lo, min(lo + rows, n)).to("cuda"))
                for lo in range(0, n, rows)]
    return step_micro_batches(batch, cfg, "cuda")  # after, after-cudnn, packed


def run(shape: str, strategy: str, mode: str, args) -> dict:
    import deepspeed

    from grpo.runtime import distributed as dist_utils
    from grpo.config.options import GRPOConfig
    from grpo.model.loading import attention_without_shape_plans
    from grpo.train.step_data import StepData
    from grpo.train.update import step_normaliser, update

    dist_utils.init_distributed()
    # before: the code before token budgets, cuDNN attention allowed; after: as grpo.model.loading.load_policy sets it
    torch.backends.cuda.enable_cudnn_sdp(True)
    if mode not in ("before", "after-cudnn"):
        attention_without_shape_plans(torch.device("cuda"))
    cfg = GRPOConfig(k_samples=args.k, rollout_max_new_tokens=args.max_new, max_prompt_length=args.prompt_len,
                     max_seq_length=args.prompt_len + args.max_new, tuning_strategy=strategy,
                     max_tokens_per_micro_batch=args.max_tokens if mode != "before" else 0,
                     logprob_chunk_tokens=args.chunk if mode != "before" else 0, padding_free=mode == "packed",
                     per_device_train_batch_size=max(1, args.rows // args.k))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(shape, strategy, args.gradient_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": False},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds)
    vocab = SHAPES[shape]["vocab_size"]
    out = {"model": shape, "strategy": strategy, "mode": mode}
    try:
        times = []
        for step in range(args.steps + 1):
            batch, advantages = make_step(vocab, args.prompts, args.k, args.prompt_len, args.max_new, seed=step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            mbs = micro_batches(batch, mode, cfg, args.rows)
            update(engine, StepData(batch, mbs, advantages, normaliser=step_normaliser(batch, cfg)), cfg)
            torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - start)
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, s_per_step=sum(times) / len(times),
                   micro_batches=len(mbs), tokens=int(batch.attention_mask.sum()))
    except torch.OutOfMemoryError:
        out.update(peak_gib=float("nan"), s_per_step=float("nan"), oom=True)
    del engine, model, optimizer
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-0.68b,qwen2.5-1.5b")
    parser.add_argument("--strategies", default="lora,full")
    parser.add_argument("--modes", default="before,after,packed")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--max_new", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch in 'before' (4 prompts x 8)")
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = parser.parse_args()
    rows = []
    print(f"GPU: {torch.cuda.get_device_name()}, {args.prompts} prompts x {args.k}, prompt {args.prompt_len}, "
          f"completions 1..{args.max_new} tokens, gradient checkpointing {args.gradient_checkpointing}")
    print("| model | strategy | mode | peak GiB | s / step | micro-batches |")
    print("|---|---|---|---|---|---|")
    for shape in args.models.split(","):
        for strategy in args.strategies.split(","):
            for mode in args.modes.split(","):
                r = run(shape, strategy, mode, args)
                rows.append(r)
                peak = "OOM" if r.get("oom") else f"{r['peak_gib']:.1f}"
                secs = "OOM" if r.get("oom") else f"{r['s_per_step']:.2f}"
                print(f"| {shape} | {strategy} | {mode} | {peak} | {secs} | {r.get('micro_batches', '-')} |",
                      flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
