"""Model and tuning strategy: what is loaded, what trains on it (--tuning_strategy, LoRA, the 4-bit base of qlora),
and the checks of those options."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from grpo.config.choices import (BITSANDBYTES_BLOCK_SIZE, DEFAULT_BLOCK_SCALE, DEFAULT_BLOCK_SIZE, EMBEDDED_MODEL,
                                 QLORA_BLOCK_SCALES, QLORA_BLOCK_SIZES, QLORA_INITS, QLORA_QUANT_TYPES,
                                 STOCK_4BIT_OPTIONS, STRATEGIES)
from grpo.config.sections.option import need, option
from grpo.config.strategy import Strategy


@dataclass
class ModelOptions:
    model_name_or_path: str = option(
        EMBEDDED_MODEL, f"HF model folder or hub id; '{EMBEDDED_MODEL}' is the embedded offline model.", "model")
    tuning_strategy: str = option(Strategy.LORA.value, "What is trained: qlora (4-bit base + LoRA), lora, or full.",
                                "model", choices=STRATEGIES)
    lora_rank: int = option(16, "LoRA rank r (lora/qlora).", "model")
    lora_alpha: int = option(32, "LoRA alpha; the update is scaled by alpha / r.", "model")
    lora_dropout: float = option(0.05, "Dropout on the LoRA input.", "model")
    lora_target_modules: str = option(
        "all-linear", "Comma-separated module names to adapt, or 'all-linear'.", "model")
    lora_exclude_modules: Optional[str] = option(
        None, "Modules LoRA must not adapt, on top of --lora_target_modules: comma-separated names (a full name or "
              "its last parts, e.g. 'mlp.down_proj'), or a regex over full names when it has regex characters "
              "(e.g. 'model\\.layers\\.[01]\\..*').", "model")
    qlora_quant_type: str = option(
        "nf4", "qlora: the 4-bit data type of the frozen base. nf4: NormalFloat, the least weight error overall. "
               "fp4: bitsandbytes' 4-bit float, with more range for a heavy-tailed layer's large weights; on "
               "SmolLM2-135M it keeps the base's arithmetic (see benchmarks/quantized_arithmetic.py).", "experimental",
        choices=QLORA_QUANT_TYPES)
    qlora_block_size: int = option(
        DEFAULT_BLOCK_SIZE,
        "qlora: weights per 4-bit scale in the frozen base. 32 follows the weights more closely than bitsandbytes' "
        "64 for 0.125 more bits per weight; on SmolLM2-135M it keeps more of the 16-bit model's arithmetic (see "
        "benchmarks/quantized_arithmetic.py --rounding). Other than 64 (or with --qlora_block_scale mse), each "
        "weight is quantized again from the checkpoint's 16-bit weights after loading, and the saved adapter "
        f"belongs to a base quantized the same way (grpo.model.loading.load_policy). {STOCK_4BIT_OPTIONS}: "
        "bitsandbytes' stock base, as transformers loads it.", "experimental", choices=QLORA_BLOCK_SIZES)
    qlora_block_scale: str = option(
        DEFAULT_BLOCK_SCALE,
        "qlora: how each block's 4-bit scale is chosen. mse: the scale (at most the block's largest magnitude) of "
        "least squared rounding error, a larger weight taking the largest code; on SmolLM2-135M it cuts the weight "
        "error by a tenth, and qlora learns arith to 0.87 of lora's accuracy (benchmarks/RESULTS.md). absmax: the "
        "block's largest magnitude (bitsandbytes' own). Either way the base is a standard bitsandbytes 4-bit model; "
        "mse (with any block size) quantizes each weight again from the checkpoint's 16-bit weights after loading.",
        "experimental", choices=QLORA_BLOCK_SCALES)
    qlora_init: str = option(
        "zero", "qlora: zero: the policy starts as the 4-bit model (B = 0). loftq: a frozen rank-r correction of "
                "the 4-bit rounding error (best rank-r approximation of W - dequantize(Q), W read from the "
                "checkpoint) is added, so the policy starts nearer the 16-bit model; the trained "
                "adapter still starts at 0, the KL reference is the corrected start, and the saved adapter is one "
                "rank-2r LoRA (trained + correction) for the 4-bit base.", "experimental",
        choices=QLORA_INITS)
    qlora_skip_modules: Optional[str] = option(
        None, "qlora: linear layers kept in 16-bit instead of 4-bit, comma-separated names or suffixes (e.g. "
              "'gate_proj,up_proj,down_proj': on SmolLM2-135M the MLP is where 4-bit rounding costs the most, see "
              "benchmarks/quantized_arithmetic.py); the output layer is always kept.", "experimental")
    lora_adapter_path: Optional[str] = option(
        None, "Continue training from a saved LoRA adapter folder (rank/alpha read from its config).", "model")
    freeze_vision_tower: bool = option(
        True, "Vision-language models: keep the vision encoder frozen (LoRA 'all-linear' then adapts the language "
        "model only).", "model")
    trust_remote_code: bool = option(False, "Allow model code from the model folder / hub repo.", "model")
    gradient_checkpointing: Optional[bool] = option(
        None, "Recompute activations in backward to save memory. Default (auto): on for models of "
              "1B parameters or more, whose micro-batch activations outgrow the weights, and always on CPU (RAM is "
              "short there); off below on a GPU, where the recomputation (one more forward) would cost time for "
              "memory the GPU has.", "model")
    save_merged_model: bool = option(
        False, "With lora/qlora, also save the base model with the adapter merged. qlora merges into the base at its "
               "original precision, which differs from the trained 4-bit policy by the rounding (with --qlora_init "
               "loftq: into the rounded base); lora_adapter/ on the base quantized as in training is that policy "
               "exactly.", "model")

    def check_model(self) -> None:
        need(self.tuning_strategy in STRATEGIES, "tuning_strategy",
             f"got '{self.tuning_strategy}', choose one of {', '.join(STRATEGIES)}")
        if self.strategy.has_adapter and not self.lora_adapter_path:
            need(self.lora_rank > 0, "lora_rank", f"must be > 0 with --tuning_strategy {self.tuning_strategy}")
            need(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        need(0.0 <= self.lora_dropout < 1.0, "lora_dropout", "must be in [0, 1)")
        need(self.lora_adapter_path is None or self.strategy.has_adapter, "lora_adapter_path",
             "needs --tuning_strategy lora or qlora (an adapter cannot be continued with full fine-tuning)")
        need(self.qlora_skip_modules is None or self.strategy is Strategy.QLORA, "qlora_skip_modules",
             "needs --tuning_strategy qlora")
        need(self.qlora_skip_modules is None or bool(self.qlora_skip_list), "qlora_skip_modules",
             "give comma-separated module names, e.g. v_proj,down_proj")
        if self.lora_exclude_modules is not None:
            self._check_lora_exclude()
        need(self.qlora_quant_type in QLORA_QUANT_TYPES, "qlora_quant_type",
             f"got '{self.qlora_quant_type}', choose one of {', '.join(QLORA_QUANT_TYPES)}")
        need(self.qlora_quant_type == "nf4" or self.strategy is Strategy.QLORA, "qlora_quant_type",
             "needs --tuning_strategy qlora")
        need(self.qlora_block_size in QLORA_BLOCK_SIZES, "qlora_block_size",
             f"got {self.qlora_block_size}, choose one of {', '.join(map(str, QLORA_BLOCK_SIZES))}")
        # the stock values pass too: a lora or full run's config saved before the defaults changed holds them
        need(self.qlora_block_size in (DEFAULT_BLOCK_SIZE, BITSANDBYTES_BLOCK_SIZE) or self.strategy is Strategy.QLORA,
             "qlora_block_size", "needs --tuning_strategy qlora")
        need(self.qlora_block_scale in QLORA_BLOCK_SCALES, "qlora_block_scale",
             f"got '{self.qlora_block_scale}', choose one of {', '.join(QLORA_BLOCK_SCALES)}")
        need(self.qlora_init in QLORA_INITS, "qlora_init",
             f"got '{self.qlora_init}', choose one of {', '.join(QLORA_INITS)}")
        if self.qlora_init == "loftq":
            need(self.strategy is Strategy.QLORA, "qlora_init", "loftq needs --tuning_strategy qlora")
            need(not self.lora_adapter_path, "qlora_init",
                 "loftq sets a new adapter; a continued one (--lora_adapter_path) keeps its own weights: drop one")

    def _check_lora_exclude(self) -> None:
        need(self.strategy.has_adapter, "lora_exclude_modules", "needs --tuning_strategy lora or qlora")
        need(not self.lora_adapter_path, "lora_exclude_modules",
             "does not apply with --lora_adapter_path (the continued adapter's own config decides what it adapts)")
        need(bool(self.lora_exclude_modules.strip().strip(",")), "lora_exclude_modules",
             "give module names (comma-separated) or a regex")
        if isinstance(self.lora_exclude, str):
            try:
                re.compile(self.lora_exclude)
            except re.error as exc:
                need(False, "lora_exclude_modules", f"'{self.lora_exclude}' is read as a regex (it has regex "
                                                    f"characters) but does not compile: {exc}")


def four_bit_experts_conflict(config, zero_stage: int, fused_expert_stacks: int) -> Optional[str]:
    """Why qlora cannot hold this model's fused experts in 4 bits under this DeepSpeed ZeRO stage, or None.

    qlora holds a mixture of experts' fused expert stacks as grpo's own Experts4bit (grpo.model.quantized_experts);
    ZeRO-3 partitions every parameter through its dense values, so it would turn each stack into 16-bit partitions
    when training starts: the run would train, but without its 4-bit experts, and the memory plan (which counts them
    at 4 bits) would not hold. ZeRO-2 keeps every parameter whole on every rank."""
    if not (config.strategy.four_bit_base and zero_stage == 3 and fused_expert_stacks):
        return None
    return (f"--tuning_strategy qlora with ZeRO-3 (--deepspeed {config.deepspeed}): this mixture of experts holds its "
            f"experts as {fused_expert_stacks} fused 3-D stacks, which qlora keeps in 4 bits as grpo's own tensors "
            "(Experts4bit); ZeRO-3 partitions every parameter and has no 4-bit form for them: it would dequantize "
            "them into 16-bit partitions. Use --deepspeed zero2 (each rank holds the experts in 4 bits), or "
            "--tuning_strategy lora under ZeRO-3 (16-bit experts, partitioned over the ranks)")
