"""A run's memory plan from its options: the model's config.json (no weights), the options resolved into a RunShape,
this rank's GPU (or the card --gpu_memory_gib names, on a machine without one) into a GpuBudget; then plan.py."""
from __future__ import annotations

import logging
import os

from grpo.errors import ConfigError
from grpo.memory.engine import CONTEXT_BYTES
from grpo.memory.model_size import ModelSize, model_size
from grpo.memory.plan import GpuBudget, MemoryPlan, RunShape, plan_memory

logger = logging.getLogger("grpo")
GIB = 2**30


def local_gpu_budget(cap_gib: float | None) -> GpuBudget | None:
    """This rank's GPU (LOCAL_RANK's), its memory and what is free on it now, plus this process's context (counted in
    every phase); None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", 0) or 0) % torch.cuda.device_count()
    torch.cuda.set_device(index)  # this rank's GPU from here on: asked about another, CUDA would open a context there
    free, total = torch.cuda.mem_get_info()
    cap = int(cap_gib * GIB) if cap_gib else None
    if cap is not None and cap > total:
        raise ConfigError(f"--gpu_memory_gib {cap_gib:g}: this GPU has {total / GIB:.1f} GiB")
    name = torch.cuda.get_device_name(index)
    return GpuBudget(total, min(total, free + CONTEXT_BYTES), cap, f"{name} ({total / GIB:.0f} GiB)")


def named_card(cap_gib: float) -> GpuBudget:
    """A card of --gpu_memory_gib's size, for a plan made on a machine without a GPU."""
    size = int(cap_gib * GIB)
    return GpuBudget(size, None, size, f"a {cap_gib:g} GiB card (--gpu_memory_gib; no GPU here)")


def load_model_config(model_path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model_name_or_path {model_path}: its config.json cannot be read ({exc})") from exc


def engine_kind(config) -> str:
    if config.rollout_mode == "server":
        return "server"
    return "vllm" if config.uses_vllm else "hf"


def capable_weights(config, hf_config, size: ModelSize, model_path: str) -> tuple[str, ...]:
    """The engine weight modes this model and these options can take (grpo.rollout.engines checks the loaded policy
    again): in_place for plain lora on one colocated GPU, adapter where vLLM's LoRA takes the model, merged from a
    16-bit checkpoint. A mixture of experts' fused experts: no adapter for a colocated engine (it could not share
    them with the trainer: the base held twice) nor under qlora (its 4-bit experts are grpo's own format,
    grpo.model.quantized_experts: no 4-bit base vLLM loads);
    server mode's lora engines load their own 16-bit base and take it."""
    from grpo.model.base_weights import saved_4bit
    from grpo.rollout.engines import VLLM_LORA_VISION_MODELS, _fused_parts_left_16bit, has_triton
    from grpo.rollout.vllm_lora import LORA_RANKS
    from grpo.sync.merge_record import KERNEL_MAX_RANK

    if not config.uses_lora:
        return ("merged",)
    vision = getattr(hf_config, "vision_config", None) is not None
    one_gpu = config.vllm_tp == 1
    stored_4bit = config.strategy.four_bit_base and bool(saved_4bit(model_path))
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    colocated = config.rollout_mode == "colocate"
    adapter = (one_gpu and not (size.fused_experts and (colocated or config.strategy.four_bit_base))
               and not getattr(text, "kv_lora_rank", None)
               and config.lora_rank <= LORA_RANKS[-1]
               and not (vision and hf_config.model_type not in VLLM_LORA_VISION_MODELS)
               and not (config.strategy.four_bit_base and (config.qlora_init == "loftq"
                                                              or _fused_parts_left_16bit(config))))
    in_place = (config.strategy.sixteen_bit_adapter and one_gpu and colocated and not vision
                and not size.fused_experts and config.lora_rank <= KERNEL_MAX_RANK and "zero3" not in config.deepspeed
                and (has_triton() or not _cuda_here()))
    if stored_4bit:
        return ("adapter",)
    return tuple(mode for mode, ok in (("in_place", in_place), ("adapter", adapter), ("merged", True)) if ok)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def run_shape(config, hf_config, size: ModelSize, model_path: str, completion_tokens: int | None = None,
              world: int | None = None) -> RunShape:
    """The options as the plan reads them. `completion_tokens`: the longest completion (a multi-turn episode's
    budget; default --rollout_max_new_tokens); `world`: the job's training ranks (default WORLD_SIZE)."""
    from grpo.memory.kv_cache import completions_per_prompt
    from grpo.memory.activations import logits_transformed

    world = world or int(os.environ.get("WORLD_SIZE", 1) or 1)
    sp = config.sequence_parallel_size
    completion = completion_tokens or config.rollout_max_new_tokens
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    zero3 = "zero3" in str(config.deepspeed)
    return RunShape(
        strategy=config.strategy, engine=engine_kind(config), tp=config.vllm_tp, dp=max(1, world // sp),
        zero3=zero3,
        sequences=config.vllm_tp * config.per_device_train_batch_size * config.gradient_accumulation_steps
        * completions_per_prompt(config),
        longest=min(config.max_seq_length, config.max_prompt_length + completion), max_seq_length=config.max_seq_length,
        sp=sp, kl_reference=config.strategy.reference_is_copy and config.kl_beta > 0,
        lora_rank=config.lora_rank, lora_dropout=config.uses_lora and config.lora_dropout > 0,
        block_size=config.qlora_block_size, chunk_tokens=config.logprob_chunk_tokens,
        full_logits=zero3 or config.logprob_chunk_tokens == 0 or logits_transformed(text),
        checkpointing=config.gradient_checkpointing, micro_batch_tokens=config.max_tokens_per_micro_batch,
        kv_cache=config.vllm_kv_cache, rollout_weights=config.rollout_weights, sleep_level=config.vllm_sleep_level,
        vllm_sleep=config.vllm_sleep, eager=config.vllm_enforce_eager,
        capable=capable_weights(config, hf_config, size, model_path), logprob_pass=config.kl_beta > 0,
        server_vllm=config.rollout_mode == "server" and config.uses_vllm)


def plan_run(config, model_path: str, completion_tokens: int | None = None, gpu: GpuBudget | None = None,
             world: int | None = None, on_gpu: bool | None = None) -> MemoryPlan:
    """The run's plan: on this rank's GPU, or (no GPU here) for the card --gpu_memory_gib names, or (`on_gpu`
    False, or neither) a CPU run's."""
    return plan_parts(config, model_path, completion_tokens, gpu, world, on_gpu)[0]


def plan_parts(config, model_path: str, completion_tokens: int | None = None, gpu: GpuBudget | None = None,
               world: int | None = None, on_gpu: bool | None = None):
    """(plan, run shape, model counts, budget, model config): the plan and what advice re-plans from. `gpu` None:
    this rank's GPU, else the card --gpu_memory_gib names, else a CPU run (always one with `on_gpu` False)."""
    hf_config = load_model_config(model_path, config.trust_remote_code)
    refused = layout_refusal(config, hf_config)
    if refused:  # what no memory lifts: the run and --plan_only refuse it alike, before any weight loads
        raise ConfigError(refused)
    size = model_size(hf_config, config)
    if gpu is None and on_gpu is not False:
        gpu = local_gpu_budget(config.gpu_memory_gib)
        if gpu is None and config.gpu_memory_gib:
            gpu = named_card(config.gpu_memory_gib)
    run = run_shape(config, hf_config, size, model_path, completion_tokens, world)
    return plan_memory(run, size, gpu, hf_config), run, size, gpu, hf_config


def layout_refusal(config, hf_config) -> str | None:
    """Why these options cannot run this model whatever the memory, or None: what its attention cannot do
    (--padding_free, --sequence_parallel_size on soft-capped attention: grpo.model.attention), and qlora's 4-bit fused
    experts under ZeRO-3 (grpo.config.sections.model.four_bit_experts_conflict)."""
    from grpo.model.attention import packing_refusal, sequence_parallel_refusal

    return ((packing_refusal(hf_config) if config.padding_free else None)
            or sequence_parallel_refusal(hf_config, config.sequence_parallel_size)
            or _four_bit_experts_refusal(config, hf_config))


def _four_bit_experts_refusal(config, hf_config) -> str | None:
    """ZeRO-3 would turn qlora's 4-bit fused experts into 16-bit partitions; the model is built on the meta device to
    count its fused expert stacks only for that combination."""
    from grpo.model.routing_replay import is_mixture_of_experts
    from grpo.runtime.deepspeed_config import load_deepspeed_config, zero_stage

    if not config.strategy.four_bit_base:
        return None
    stage = zero_stage(load_deepspeed_config(config, use_bf16=True))
    if stage != 3 or not is_mixture_of_experts(hf_config):
        return None
    # (the model code, only for that combination)
    from grpo.config.sections.model import four_bit_experts_conflict
    from grpo.memory.model_size import build_on_meta
    from grpo.model.quantized_experts import fused_expert_slots

    stacks = len(fused_expert_slots(build_on_meta(hf_config, config.trust_remote_code)))
    return four_bit_experts_conflict(config, stage, stacks)


def checked_plan(config, model_path: str, completion_tokens: int | None = None,
                 gpu: GpuBudget | None = None) -> MemoryPlan:
    """The run's plan, logged; a ConfigError with the cheapest changes that fit where it does not fit."""
    from grpo.memory.advice import cheapest_fixes
    from grpo.memory.report import plan_table, refusal

    plan, run, size, gpu, hf_config = plan_parts(config, model_path, completion_tokens, gpu)
    if not plan.fits:
        raise ConfigError(refusal(plan, cheapest_fixes(run, size, gpu, hf_config, config)))
    logger.info(plan_table(plan))
    warning = _waves_warning(plan, run, size, gpu, hf_config, config)
    if warning:
        logger.warning(warning)
    return plan


def _waves_warning(plan, run, size, gpu, hf_config, config) -> str | None:
    from grpo.memory.advice import MAX_WAVES, few_waves_fixes, rollout_waves, waves_warning

    if not plan.fits or rollout_waves(plan) <= MAX_WAVES:
        return None
    return waves_warning(plan, few_waves_fixes(run, size, gpu, hf_config, config))


def print_plan(config) -> int:
    """--plan_only: the plan as a table on stdout (with what fits, where it does not); 0 if it fits, else 1."""
    from grpo.memory.advice import cheapest_fixes
    from grpo.memory.report import plan_table, refusal
    from grpo.model.embedded import resolve_model_path

    if config.uses_vllm and not config.gpu_memory_gib and not _cuda_here():
        raise ConfigError("--plan_only: there is no GPU here to plan for; name the card with --gpu_memory_gib "
                          "(e.g. --gpu_memory_gib 24 for a 24 GB card)")
    from grpo.model.model_source import check_positions

    model_path = resolve_model_path(config.model_name_or_path)
    check_positions(model_path, config)  # refused (or a default --max_seq_length cut) as the run does, before planning
    plan, run, size, gpu, hf_config = plan_parts(config, model_path)
    if plan.fits:
        print(plan_table(plan))
        warning = _waves_warning(plan, run, size, gpu, hf_config, config)
        if warning:
            print(f"  warning: {warning}")
        return 0
    print(refusal(plan, cheapest_fixes(run, size, gpu, hf_config, config)))
    return 1


def agreed_plan(plan: MemoryPlan | None, config, model_path: str, completion_tokens: int) -> MemoryPlan | None:
    """The plan every rank runs: planned again for the least budget of any rank where this rank's is larger (the
    ranks of a tensor-parallel group must size their KV caches alike). Call on every rank, after the process group
    started."""
    from grpo.runtime import distributed as dist_utils

    if plan is None or not plan.budget or dist_utils.world_size() == 1:
        return plan
    least = int(-dist_utils.all_max([-float(plan.budget)])[0])
    if least >= plan.budget:
        return plan
    mine = local_gpu_budget(config.gpu_memory_gib)
    logger.info(f"memory plan: another rank has {least / GIB:.2f} GiB, this one {plan.budget / GIB:.2f}: every rank "
                "plans for the least")
    return checked_plan(config, model_path, completion_tokens,
                        gpu=GpuBudget(mine.total, least, mine.cap, mine.name))
