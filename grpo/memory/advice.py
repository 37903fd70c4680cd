"""The cheapest changes that make a plan fit: each candidate change of the options is planned again (the same
pure planner, on the same model counts and budget), and those that fit are said, cheapest first: the engine's
weights, checkpointing and the chunk cost speed only; then shorter completions, fewer samples or prompts (what is
learned changes); then a leaner strategy; then a larger budget."""
from __future__ import annotations

import dataclasses
import math

from grpo.config.strategy import Strategy
from grpo.memory.model_size import ModelSize
from grpo.memory.plan import GpuBudget, RunShape, plan_memory

GIB = 2**30


def _fits(run: RunShape, size: ModelSize, gpu: GpuBudget, hf_config) -> bool:
    return plan_memory(run, size, gpu, hf_config).fits


def cheapest_fixes(run: RunShape, size: ModelSize, gpu: GpuBudget, hf_config, options) -> list[str]:
    """Flags (as one would type them) that make the plan fit, cheapest first; at most one of each kind.
    `options`: the run's GRPOConfig (for the current lengths and counts)."""
    fixes: list[str] = []

    def attempt(flag: str, **changes) -> bool:
        if _fits(dataclasses.replace(run, **changes), size, gpu, hf_config):
            fixes.append(flag)
            return True
        return False

    for mode in ("in_place", "adapter"):
        if run.engine == "vllm" and mode in run.capable and run.rollout_weights != mode:
            if attempt(f"--rollout_weights {mode}", rollout_weights=mode):
                break
    if run.checkpointing is not True and not run.sp > 1:
        attempt("--gradient_checkpointing true", checkpointing=True)
    if run.chunk_tokens > 128 and not run.full_logits:
        attempt("--logprob_chunk_tokens 256", chunk_tokens=256)
    # shorter completions, the longest that fits (halving); a default --max_seq_length follows them, a given one
    # is suggested with them
    from grpo.config.options import MIN_DEFAULT_SEQ_LENGTH

    prompt, given = options.max_prompt_length, options.rollout_max_new_tokens
    stated = getattr(options, "given_options", None)  # the flags given, where the command line says (cli.py)
    default_seq = "max_seq_length" not in stated if stated is not None else \
        options.max_seq_length == max(prompt + given, MIN_DEFAULT_SEQ_LENGTH)
    new = given // 2
    while new >= 64:
        seq = max(prompt + new, MIN_DEFAULT_SEQ_LENGTH) if default_seq else min(options.max_seq_length, prompt + new)
        # (said with the length it leaves wherever that changes: a given --max_seq_length would stay)
        flag = f"--rollout_max_new_tokens {new}" + ("" if default_seq or seq == options.max_seq_length
                                                    else f" --max_seq_length {seq}")
        if attempt(flag, longest=min(seq, prompt + new), max_seq_length=seq):
            break
        new //= 2
    per_sequence = max(run.sequences // max(options.k_samples, 1), 1)
    k = options.k_samples // 2
    while k >= 2:
        if attempt(f"--k_samples {k}", sequences=per_sequence * k):
            break
        k //= 2
    if not run.strategy.has_adapter:
        attempt("--tuning_strategy lora", strategy=Strategy.LORA, capable=("in_place", "adapter", "merged"))
    if not run.strategy.four_bit_base:
        attempt("--tuning_strategy qlora", strategy=Strategy.QLORA, capable=("adapter", "merged"))
    for extra in (4, 8, 16, 24, 32, 48, 64, 96, 128):  # the smallest larger budget that fits
        cap = math.ceil(gpu.budget / GIB) + extra
        if _fits(run, size, GpuBudget(max(gpu.total, cap * GIB), None, cap * GIB, gpu.name), hf_config):
            here = gpu.free is not None and cap * GIB <= gpu.total
            fixes.append(f"--gpu_memory_gib {cap}" if here else f"a GPU with {cap} GiB (--gpu_memory_gib {cap})")
            break
    return fixes
