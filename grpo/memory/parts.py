"""The bytes of a plan's parts that depend on the strategy and the model's counts: the trainer's persistent parts,
what the rollout engine holds beyond them, the policy's load and a weight sync's merge (the equations of
grpo/memory/plan.py's docstring)."""
from __future__ import annotations

from grpo.memory.model_size import ModelSize, weight_bytes

# `run` below is the plan's RunShape (grpo.memory.plan, which imports this module)


def trainer_parts(run, size: ModelSize, float_bytes: int) -> dict:
    """The trainer's persistent parts and its gradients (module docstring), bytes on one GPU."""
    base = weight_bytes(size, run.strategy, float_bytes, run.block_size) - float_bytes * (
        size.adapter if run.strategy.has_adapter else 0)
    trainable = size.adapter if run.strategy.has_adapter else size.parameters - size.vision
    master = 4 if float_bytes == 2 else 0  # bf16 training keeps an fp32 master copy
    parts = {"base": base // (run.dp if run.zero3 else 1),
             "adapters": float_bytes * size.adapter if run.strategy.has_adapter else 0,
             "optimizer": (master + 8) * trainable // run.dp,
             "gradients": float_bytes * trainable + (4 * trainable // run.dp if master else 0)}
    if run.kl_reference:
        parts["reference"] = float_bytes * size.parameters // (run.dp if run.zero3 else 1)
    return parts


def engine_weight_bytes(mode: str, run, size: ModelSize) -> int:
    """What the engine holds beyond the trainer's base: merged its own 16-bit copy; adapter its LoRA slots (at vLLM's
    rank, the base shared); in_place nothing."""
    if mode == "merged":
        return 2 * size.parameters // run.tp
    if mode == "adapter":
        from grpo.rollout.vllm_lora import engine_lora_rank

        rank = engine_lora_rank(run.lora_rank)
        embeddings = 2 * rank * (2 * size.shape.vocab + 2 * size.shape.hidden)
        return 2 * size.adapter_all_linear * rank // max(run.lora_rank, 1) + embeddings
    return 0


def load_peak_bytes(run, size: ModelSize) -> int:
    """The policy's load, where it can exceed its held base: qlora on a mixture of experts, whose fused experts load
    in 16 bits and which grpo quantizes itself (grpo.model.quantized_experts); 0 elsewhere (not a phase).

    By design experts_quantized_as_loaded quantizes each stack as transformers sets it into the model, so the load
    would hold the 4-bit base plus one 16-bit stack (2 x size.largest_tensor) at a time. As measured on a GPU under
    transformers 5.17 (an 8-layer Qwen3-MoE, docs/moe.md) the load still peaked at the 16-bit model's size, before
    the first stack was quantized: the plan counts that, 2 P, until a measurement shows the one-stack peak. The
    rollout engine loads after the policy, so nothing else of the run is beside it."""
    if not (run.strategy.four_bit_base and size.quantized_experts):
        return 0
    return 2 * size.parameters  # as measured (docstring); the design's peak would be base + 2 x largest stack


def sync_merge_bytes(run, size: ModelSize) -> int:
    """What a weight sync merges at once beside the engine: 2 b (largest layer); with LoRA on fused experts (lora and
    qlora alike) at least one expert stack's merge, W_e + s B_e A_e for every expert in fp32: the stack read (qlora:
    dequantized), the delta and the merged copy, 3 x 4 x E out in bytes (grpo.sync.expert_adapters.merged_experts;
    Qwen3-30B-A3B's gate_up_proj: 4.5 GiB)."""
    merge = 2 * 2 * size.largest_layer
    if run.strategy.has_adapter and size.largest_adapted_stack:
        merge = max(merge, 3 * 4 * size.largest_adapted_stack)
    return merge
