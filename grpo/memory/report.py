"""The plan as people read it: a short table (printed at the start of every run and by --plan_only, saved beside the
run as memory_plan.json), and the refusal of a plan that does not fit, with the cheapest changes that do."""
from __future__ import annotations

import json
import os

from grpo.memory.plan import MemoryPlan

GIB = 2**30
PLAN_FILE = "memory_plan.json"
PHASE_LABELS = {"load": "load (16-bit experts)", "rollout": "rollout (engine awake)", "logprobs": "old / reference log-probs",
                "train": "training (one micro-batch)", "sync": "weight sync"}


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def plan_table(plan: MemoryPlan) -> str:
    """The plan in a few lines: the budget, the choices, the parts and each phase's peak."""
    if not plan.budget:
        lines = [f"memory plan for a CPU run (RAM; nothing is refused): micro-batches of {plan.micro_batch_tokens} "
                 f"tokens, gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}"
                 + (f", the rollout ranks' vLLM weights {plan.rollout_weights}" if plan.rollout_weights else "")]
    else:
        lines = [f"memory plan for {plan.gpu}: budget {gib(plan.budget)} GiB"
                 + (" (--gpu_memory_gib)" if plan.capped else "")]
        choices = []
        if plan.rollout_weights and plan.sleep_level is not None:
            choices.append(f"vLLM weights {plan.rollout_weights}, sleep level {plan.sleep_level}")
        elif plan.rollout_weights:
            choices.append(f"the rollout ranks' vLLM weights {plan.rollout_weights}")
        if plan.kv_cache_bytes:
            choices.append(f"KV cache {gib(plan.kv_cache_bytes)} GiB ({plan.sequences_at_once:.1f} of "
                           f"{plan.sequences} sequences of {plan.longest} tokens at once)")
        if plan.engine_max_seqs:
            choices.append(f"vLLM batches of {plan.engine_batched_tokens} tokens / {plan.engine_max_seqs} sequences")
        choices.append(f"micro-batches of {plan.micro_batch_tokens} tokens, log-prob chunks of "
                       f"{plan.logprob_chunk_tokens}, checkpointing {'on' if plan.gradient_checkpointing else 'off'}")
        lines.append("  choices: " + "; ".join(choices))
    parts = ", ".join(f"{name} {gib(value)}" for name, value in plan.parts.items() if value)
    lines.append(f"  parts (GiB): {parts}")
    lines.append("  phase                          planned peak GiB")
    for name, value in plan.phases.items():
        lines.append(f"  {PHASE_LABELS.get(name, name):<30} {gib(value):>8}")
    lines.extend(f"  note: {note}" for note in plan.notes)
    if not plan.fits:
        lines.append(f"  DOES NOT FIT: {plan.why_not}")
    return "\n".join(lines)


def save_plan(plan: MemoryPlan, output_dir: str) -> str:
    path = os.path.join(output_dir, PLAN_FILE)
    with open(path, "w") as fh:
        json.dump({**plan.to_json(), "table": plan_table(plan)}, fh, indent=1)
    return path


def refusal(plan: MemoryPlan, advice: list[str]) -> str:
    """Why the run is refused before loading, and what fits instead."""
    fixes = "; or ".join(advice) if advice else ("none of the usual changes fits: a GPU with more memory, or "
                                                "several GPUs with --deepspeed zero3")
    return (f"the memory plan does not fit {plan.gpu}'s {gib(plan.budget)} GiB budget: {plan.why_not}. "
            f"What fits: {fixes}.\n{plan_table(plan)}")
