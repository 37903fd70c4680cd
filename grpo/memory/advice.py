"""The cheapest changes that make a plan fit: each candidate change of the options is planned again (the same
pure planner, on the same model counts and budget), and those that fit are said, cheapest first: the engine's
weights, checkpointing and the chunk cost speed only; then shorter completions, fewer samples or prompts (what is
learned changes); then a leaner strategy; then generation in the trainer's own model (--rollout_engine hf: no
engine copy, slower rollouts); then a larger budget."""
from __future__ import annotations

import dataclasses
import math

from grpo.config.strategy import Strategy
from grpo.memory.model_size import ModelSize
from grpo.memory.plan import GpuBudget, RunShape, plan_memory

GIB = 2**30


# a rollout whose KV cache holds fewer than 1 / MAX_WAVES of the step's sequences decodes in more than this many
# rounds one after the other: the step takes about that many times as long as with all at once
MAX_WAVES = 4


def rollout_waves(plan) -> int:
    """Rounds of decoding the rollout runs in: the step's sequences over those the KV cache holds at once."""
    return math.ceil(plan.sequences / max(plan.sequences_at_once, 1e-9) - 1e-6) if plan.sequences else 1


def _few_waves(plan) -> bool:
    return rollout_waves(plan) <= MAX_WAVES


def cheapest_fixes(run: RunShape, size: ModelSize, gpu: GpuBudget, hf_config, options, goal=None) -> list[str]:
    """Flags (as one would type them) that make the plan fit, cheapest first; at most one of each kind.
    `options`: the run's GRPOConfig (for the current lengths and counts). `goal(plan)`: what a fitting plan must
    also meet (e.g. few_waves_fixes' rollout in few rounds)."""
    fixes: list[str] = []

    def _fits(run: RunShape, size: ModelSize, gpu: GpuBudget, hf_config) -> bool:
        plan = plan_memory(run, size, gpu, hf_config)
        return plan.fits and (goal is None or goal(plan))

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
    def capable(strategy: Strategy, modes: tuple[str, ...]) -> tuple[str, ...]:
        """planner.capable_weights' rule for fused experts: no in_place; no adapter under qlora (its 4-bit experts
        are grpo's own) nor for a colocated engine."""
        if not size.fused_experts:
            return modes
        return tuple(m for m in modes if m == "merged" or (m == "adapter" and run.engine == "server"
                                                            and not strategy.four_bit_base))

    if not run.strategy.has_adapter:
        attempt("--tuning_strategy lora", strategy=Strategy.LORA,
                capable=capable(Strategy.LORA, ("in_place", "adapter", "merged")))
    if not run.strategy.four_bit_base:
        attempt("--tuning_strategy qlora", strategy=Strategy.QLORA,
                capable=capable(Strategy.QLORA, ("adapter", "merged")))
    if run.engine == "vllm":  # the trainer's own model generates: no second copy of the weights (decodes slower)
        attempt("--rollout_engine hf", engine="hf")
    def fits_in(cap: int) -> bool:
        return _fits(run, size, GpuBudget(max(gpu.total, cap * GIB), None, cap * GIB, gpu.name), hf_config)

    # the smallest larger budget that fits, in whole GiB: the first of these steps that fits, then halving the gap
    # below it (a larger budget never plans worse)
    start, below = math.ceil(gpu.budget / GIB), math.ceil(gpu.budget / GIB)
    for extra in (4, 8, 16, 24, 32, 48, 64, 96, 128):
        cap = start + extra
        if fits_in(cap):
            while cap - below > 1:
                middle = (cap + below) // 2
                cap, below = (middle, below) if fits_in(middle) else (cap, middle)
            here = gpu.free is not None and cap * GIB <= gpu.total
            fixes.append(f"--gpu_memory_gib {cap}" if here else f"a GPU with {cap} GiB (--gpu_memory_gib {cap})")
            break
        below = cap
    return fixes


def few_waves_fixes(run: RunShape, size: ModelSize, gpu: GpuBudget, hf_config, options) -> list[str]:
    """The cheapest changes that let a fitting plan's rollout decode in at most MAX_WAVES rounds."""
    return cheapest_fixes(run, size, gpu, hf_config, options, goal=_few_waves)


def waves_warning(plan, fixes: list[str]) -> str | None:
    """A line for a plan whose rollout decodes in many rounds (a 16 GB card with 8,192 new tokens: one sequence
    at a time), None where it is few."""
    waves = rollout_waves(plan)
    if not plan.fits or waves <= MAX_WAVES:
        return None
    return (f"the KV cache holds {plan.sequences_at_once:.1f} of the step's {plan.sequences} sequences at once: the "
            f"rollout decodes in about {waves} rounds, one after the other (a step takes several times as long as "
            f"with all at once). Fewer rounds: " + ("; or ".join(fixes) if fixes else "a GPU with more memory"))
