"""Which rollout engine a training rank gets, and what it computes in."""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile

import torch

from grpo.errors import ConfigError
from grpo.model.base_weights import saved_4bit
from grpo.runtime.deepspeed_config import zero3_partitioned
from grpo.runtime.gpu_budget import engine_memory_share
from grpo.rollout.hf import HFRolloutEngine, stop_token_ids
from grpo.sync.shared_base import park_frozen_base, restore_parked
from grpo.sync.weight_sync import converted_on_load

logger = logging.getLogger("grpo")


def engine_holds_weights(config) -> bool:
    """Whether the engine has weights of its own to sync (vLLM, or the rollout ranks of server mode); the colocated
    HF engine samples the live policy module."""
    return config.uses_vllm or config.rollout_mode == "server"


def engine_dtype(config, trainer_dtype: torch.dtype) -> torch.dtype:
    """What the engine computes in, so what the sync sends: vLLM bf16; an HF engine the trainer's own dtype."""
    return torch.bfloat16 if config.uses_vllm else trainer_dtype


def build_rollout_engine(config, model_path: str, policy, tokenizer, vision, rank: int, trainer_dtype: torch.dtype,
                         completion_tokens: int | None = None, episode_datasets: list[str] | None = None,
                         plan=None):
    """Server mode: the rollout ranks, reached through RemoteRolloutEngine; otherwise a colocated vLLM engine, or
    the HF engine over the policy module itself. `plan`: the run's grpo.memory.plan.MemoryPlan, which made every
    automatic choice: a vLLM engine takes its weights (server mode: sent to the rollout ranks with the engine's
    spec), a colocated one its sleep level, KV cache bytes and batch limits too; nothing here decides them again.
    `episode_datasets`: the datasets whose rows run as episodes, which server mode's rollout ranks run."""
    if config.uses_vllm and config.rollout_mode == "colocate" and plan is None:
        raise ValueError("a colocated vLLM engine takes the memory plan's choices (its weights, sleep level, KV cache "
                         "and batch limits): pass the run's plan (grpo.memory.planner.checked_plan)")
    stops = stop_token_ids(policy, tokenizer)
    planned = plan.rollout_weights if plan is not None else None
    weights = engine_weights(config, policy, vision, model_path, planned) if config.uses_vllm else "merged"
    adapter, in_place = weights == "adapter", weights == "in_place"
    lora_rank = adapter_rank(policy) if adapter else None
    if config.rollout_mode == "server":
        from grpo.rollout.remote import RemoteRolloutEngine
        from grpo.runtime import distributed as dist_utils

        spec = dict(dtype=str(engine_dtype(config, trainer_dtype)).removeprefix("torch."), stop_token_ids=stops,
                    max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                    image_token_id=vision.image_token_id if vision else None,
                    suppress_token_ids=vision.placeholder_token_ids if vision else None, lora_rank=lora_rank,
                    rollout_weights=weights,  # the plan's choice, as the loaded policy took it: the ranks take it
                    episode_datasets=list(episode_datasets or []))
        logger.info(f"waiting for {config.rollout_gpus} rollout rank(s) to start their engines")
        # qlora: the rollout ranks load training rank 0's 4-bit base from a folder in --output_dir, which they
        # must see (on another node: shared storage); it goes once their engines hold the weights
        writes = adapter and config.strategy.four_bit_base and dist_utils.is_main()
        with _engine_base(config, policy, model_path if writes else None, config.output_dir,
                          keep=vision is not None) as base:
            if base is not None:
                spec.update(model_path=base, quantized=True)
            return RemoteRolloutEngine(spec, config.rollout_gpus, config.ddp_timeout_minutes,
                                       images_as_decoded=config.uses_vllm)
    if config.uses_vllm:
        quantized = adapter and config.strategy.four_bit_base
        # adapter: the engine loads the trainer's own base (lora: the same 16-bit checkpoint; qlora: the trainer's 4-bit
        # base, written for it), while the trainer's waits in CPU memory; then the trainer's views the engine's
        # vLLM keeps weights, not files (but a vision-language engine's processor files: kept)
        with _engine_base(config, policy, model_path if quantized else None, keep=vision is not None) as base:
            parked = park_frozen_base(policy) if (adapter or in_place) and config.vllm_tp == 1 else {}
            try:
                engine = _vllm_engine(config, base or model_path, rank, vision, stops, plan, lora_rank=lora_rank,
                                      quantized=quantized, sleep_level=engine_sleep_level(config, plan, weights),
                                      merge_in_place=in_place)
            except BaseException:
                restore_parked(policy, parked)
                raise
        if adapter or in_place:
            _share_base(engine, policy, parked)
        if in_place and not engine.merges_in_place and config.rollout_weights == "in_place":
            engine.close()
            raise ConfigError("--rollout_weights in_place: the trainer's LoRA base could not be shared with the vLLM "
                              "engine (the log says how much was), so the GPU would hold two 16-bit copies; use "
                              "--rollout_weights merged")
        if in_place:
            release_base_before_forward(engine, policy)
        return engine
    return HFRolloutEngine(policy, tokenizer, suppress_token_ids=vision.placeholder_token_ids if vision else None,
                           record_routing=bool(config.routing_replay))


def _share_base(engine, policy, parked: dict) -> None:
    shared = engine.share_base(policy, parked)
    if shared is None or not shared.shared:
        logger.info("vLLM and the trainer each hold the base (its tensors could not be shared here"
                    + ("; the engine takes merged weights instead" if engine.takes_adapter is False else "") + ")")
        return
    logger.info(f"the trainer's frozen base is the vLLM engine's own: {shared.shared_bytes / 2**30:.2f} GiB held once "
                f"({shared.shared} tensors shared, {shared.kept} kept); the engine's sleeps drop its KV cache only"
                + ("; the adapter is merged into it for each rollout and taken out after" if engine.merges_in_place
                   else ""))


def release_base_before_forward(engine, policy) -> None:
    """In-place mode: every forward of the policy starts by taking the adapter out of the shared base (a no-op
    unless merged: the engine merges for a rollout and takes it out once the completions are in or when it sleeps,
    so this guards other orders)."""
    if engine.merges_in_place:
        policy.get_input_embeddings().register_forward_pre_hook(lambda module, args: engine.release_base())


# 4-bit bases a vision-language engine still reads (vLLM loads the processor from the model folder at the first
# image prompt, not at start): removed when the process exits
_KEPT_BASES: list[str] = []


def remove_kept_bases() -> None:
    while _KEPT_BASES:
        shutil.rmtree(_KEPT_BASES.pop(), ignore_errors=True)


atexit.register(remove_kept_bases)


@contextlib.contextmanager
def _engine_base(config, policy, model_path: str | None, parent: str | None = None, keep: bool = False):
    """The folder an adapter-taking engine loads the qlora base from: a checkpoint saved in 4 bits as it is, else the
    trainer's own 4-bit base written for the purpose (removed on exit, or, `keep`, when the process exits). None for
    `model_path` None."""
    if model_path is None:
        yield None
    elif saved_4bit(model_path):
        yield model_path
    else:
        from grpo.model.quantized_checkpoint import write_4bit_checkpoint

        if parent:
            os.makedirs(parent, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=".grpo-4bit-base-", dir=parent)
        try:
            write_4bit_checkpoint(policy, folder, source=model_path)  # (with its tokenizer and processor files)
            yield folder
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if keep:
            _KEPT_BASES.append(folder)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def engine_weights(config, policy, vision, model_path: str | None = None, planned: str | None = None) -> str:
    """--rollout_weights for this model: "in_place", "adapter" or "merged". auto takes the memory plan's choice
    (`planned`: grpo.memory.plan.preferred_weights weighs sizes and speed, and is the only place auto is decided),
    which the loaded policy may still refuse: in_place falls back as adapter does, adapter to merged, said once; an
    explicit choice that cannot be is an error. A checkpoint saved in 4 bits has no 16-bit weights for a merged
    engine to start from: adapter. The errors about --rollout_weights that need the loaded policy are all here."""
    choice = planned if config.rollout_weights == "auto" else config.rollout_weights
    if choice is None:
        raise ValueError("--rollout_weights auto is the memory plan's choice (grpo.memory.plan.preferred_weights): "
                         "pass the plan's rollout_weights as `planned`")
    if choice == "in_place":
        why = _in_place_refusal(policy, vision)
        if why is None:
            logger.info("vLLM holds the base once, shared with the trainer; each rollout merges the adapter into it "
                        f"and takes it out after (--rollout_weights {config.rollout_weights})")
            return "in_place"
        if config.rollout_weights == "in_place":
            raise ConfigError(f"--rollout_weights in_place merges one plain LoRA adapter into the shared base, which "
                              f"cannot take {why}: use --rollout_weights merged")
        logger.info(f"vLLM cannot merge in place into the shared base ({why}): the adapter instead")
        choice = "adapter"  # auto: as for qlora
    stored_4bit = model_path is not None and config.strategy.four_bit_base and bool(saved_4bit(model_path))
    if stored_4bit:
        if config.rollout_weights == "merged":
            raise ConfigError(f"--rollout_weights merged starts vLLM from the 16-bit checkpoint, and {model_path} is "
                              "saved in 4 bits: use --rollout_weights adapter (or auto)")
        if config.vllm_tp > 1:
            raise ConfigError(f"{model_path} is saved in 4 bits, which vLLM 0.26 loads on one GPU per engine only: "
                              "use --vllm_tp 1")
        choice = "adapter"
    if choice != "adapter":
        if choice == "merged" and config.uses_lora:
            logger.info(f"vLLM takes merged weights (--rollout_weights {config.rollout_weights}; the memory plan says "
                        "why)")
        return choice
    why = _adapter_refusal(config, policy, vision, stored_4bit)
    if why is not None:
        if stored_4bit:  # nor can a merged engine start: there are no 16-bit weights
            raise ConfigError(f"{model_path} is saved in 4 bits, which vLLM takes only with the adapter, and vLLM's "
                              f"LoRA cannot take {why}: start from the 16-bit checkpoint, or use --rollout_engine hf")
        if config.rollout_weights == "adapter":
            raise ConfigError(f"--rollout_weights adapter: vLLM's LoRA cannot take {why}; use --rollout_weights "
                              "merged")
        logger.info(f"vLLM takes merged weights: its LoRA cannot take {why} (--rollout_weights auto)")
        return "merged"
    logger.info("vLLM holds the base once and takes the adapter at each sync (--rollout_weights "
                f"{config.rollout_weights})")
    return "adapter"


def _adapter_refusal(config, policy, vision, stored_4bit: bool) -> str | None:
    """Why vLLM's LoRA cannot take this policy's adapter, or None."""
    peft_config = getattr(policy, "peft_config", {}).get("default")
    if vision:
        why = _vision_refusal(policy)
        if why:
            return why
    split = _fused_parts_left_16bit(config) if config.strategy.four_bit_base and not stored_4bit else None
    if split:
        return split
    if getattr(getattr(policy, "config", None), "kv_lora_rank", None):
        # measured on a DeepSeek-V2 shape (H200, 2026-11-27): vLLM's LoRA scored 0.38-0.76 nats off the policy
        return "MLA attention (DeepSeek-V2/V3)"
    fused = _fused_on_load(policy)
    if fused and config.strategy.four_bit_base:
        # lora: the engine loads the 16-bit checkpoint and takes LoRA on the experts per expert (expert_adapters)
        return (f"{fused}: a mixture of experts under qlora, whose fused experts the trainer holds in 4 bits in "
                "grpo's own format (grpo.model.quantized_experts), not as a bitsandbytes checkpoint vLLM loads (the "
                "merged sync sends them dequantized, with their LoRA folded in)")
    for option, why in (("modules_to_save", "modules_to_save (vLLM's LoRA takes LoRA layers only)"),
                        ("use_dora", "DoRA"), ("lora_bias", "lora_bias")):
        if getattr(peft_config, option, None):
            return why
    return None


# vision-language models whose vLLM 0.26 class takes LoRA on its language model (SupportsLoRA, get_mm_mapping:
# vllm/model_executor/models/qwen2_5_vl.py and qwen2_vl.py; docs/vision.md)
VLLM_LORA_VISION_MODELS = ("qwen2_vl", "qwen2_5_vl")


def _vision_refusal(policy) -> str | None:
    """Why vLLM's LoRA cannot take this vision-language policy's adapter, or None. vLLM 0.26 wraps the language
    model's layers alone (LoRA on the vision tower is an experimental option, enable_tower_connector_lora, off in grpo):
    an adapter on the tower would leave it unadapted in the engine, which would then sample another policy."""
    from grpo.model.layer_weights import checkpoint_name
    from grpo.model.vision import vision_lora_layers

    model_type = getattr(getattr(policy, "config", None), "model_type", None)
    if model_type not in VLLM_LORA_VISION_MODELS:
        return f"the vision-language model {model_type!r} (grpo syncs adapters into Qwen2-VL and Qwen2.5-VL only)"
    on_tower = vision_lora_layers(policy)
    if on_tower:
        return (f"LoRA on the vision tower ({len(on_tower)} layers, e.g. {checkpoint_name(on_tower[0])}; vLLM adapts "
                "the language model only): leave vision layers out of --lora_target_modules")
    return None


def _in_place_refusal(policy, vision) -> str | None:
    """Why in-place mode cannot take this policy, or None."""
    from grpo.sync.merge_record import KERNEL_MAX_RANK

    peft_config = getattr(policy, "peft_config", {}).get("default")
    if vision:
        return "a vision-language model (checked on text models only; --rollout_weights adapter holds one base for it)"
    for option, why in (("modules_to_save", "modules_to_save"), ("use_dora", "DoRA"), ("lora_bias", "lora_bias"),
                        ("fan_in_fan_out", "fan_in_fan_out layers")):
        if getattr(peft_config, option, None):
            return why
    if zero3_partitioned(policy):
        return "ZeRO-3 (a rank holds a partition of the base, which vLLM cannot share)"
    fused = _fused_on_load(policy)
    if fused:
        return fused
    if adapter_rank(policy) > KERNEL_MAX_RANK:
        return f"a LoRA rank above {KERNEL_MAX_RANK} (its kernels' limit)"
    if not has_triton():
        return "a merge without Triton (its kernels need it)"
    return None


def _fused_on_load(policy) -> str | None:
    """Tensors that transformers converted on load (a mixture-of-experts model's fused experts): vLLM holds them as
    the checkpoint has them, so the trainer could not share them, and the base would be held twice."""
    converted = sorted(converted_on_load(policy))
    if not converted:
        return None
    return (f"tensors that transformers fused or moved on load ({len(converted)}, e.g. {converted[0]}), which the "
            "trainer cannot share with vLLM (it holds them as the checkpoint does)")


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# layers vLLM fuses into one (packed_modules_mapping) and so quantizes, or leaves in 16 bits, as a whole
VLLM_FUSED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                    "up_proj": "gate_up_proj"}


def _fused_parts_left_16bit(config) -> str | None:
    """Why an adapter engine cannot load the trainer's 4-bit base: --qlora_skip_modules keeps a part of a layer vLLM
    fuses (q_proj of qkv_proj, ...) in 16 bits, and vLLM 0.26 matches its skip list against the fused layer's name,
    so it would read 4-bit weights where the base has 16-bit ones. None when nothing is split so."""
    parts = sorted({name.rpartition(".")[2] for name in config.qlora_skip_list} & VLLM_FUSED_PARTS.keys())
    if not parts:
        return None
    fused = sorted({VLLM_FUSED_PARTS[p] for p in parts})
    return (f"--qlora_skip_modules {','.join(parts)} (vLLM quantizes {' and '.join(fused)} as one layer, so it "
            "cannot leave a part of it in 16 bits)")


def engine_sleep_level(config, plan, weights: str) -> int:
    """--vllm_sleep_level, or the memory plan's level for the weights the engine took (MemoryPlan.sleep_level_for:
    the planned level for the planned weights, its level for weights the loaded policy made it take instead)."""
    if config.vllm_sleep_level is not None:
        return config.vllm_sleep_level
    return plan.sleep_level_for(weights)


def adapter_rank(policy) -> int:
    """The largest LoRA rank of the policy (rank patterns included): what the engine's LoRA slots must hold."""
    peft_config = policy.peft_config["default"]
    return max([peft_config.r, *(peft_config.rank_pattern or {}).values()])


# vLLM checks at start that this share of the GPU is free even where it is given its KV cache in bytes, and reads it
# for nothing else then (vllm/v1/worker/utils.py request_memory, 0.26): a token share
SHARE_BESIDE_KV_BYTES = 0.01


def _vllm_engine(config, model_path: str, rank: int, vision, stops, plan, lora_rank: int | None = None,
                 quantized: bool = False, sleep_level: int = 2, merge_in_place: bool = False):
    from grpo.rollout.vllm import VLLMRolloutEngine

    # the plan's cache (auto sized, or as given); None: a model the plan cannot size a cache for, left to the share
    kv_bytes = plan.kv_cache_bytes
    share = SHARE_BESIDE_KV_BYTES if kv_bytes else engine_memory_share(config.vllm_memory_share, config.gpu_memory_gib)
    limits = dict(max_num_seqs=plan.engine_max_seqs, max_num_batched_tokens=plan.engine_batched_tokens) \
        if plan.engine_max_seqs else {}
    # ranks of one tensor-parallel group share a seed: they must sample the same completions
    return VLLMRolloutEngine(model_path, tensor_parallel_size=config.vllm_tp, gpu_memory_utilization=share,
                             kv_cache_bytes=kv_bytes, max_model_len=config.max_seq_length,
                             seed=config.seed + rank // config.vllm_tp, enable_sleep=config.vllm_sleep,
                             sleep_level=sleep_level, enforce_eager=config.vllm_enforce_eager, stop_token_ids=stops,
                             max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                             image_token_id=vision.image_token_id if vision else None,
                             lora_rank=lora_rank, quantized=quantized, merge_in_place=merge_in_place,
                             # a cap on torch counts its cached blocks: hand them back at every sleep and wake
                             keep_torch_cache=config.gpu_memory_gib is None, record_routing=bool(config.routing_replay),
                             **limits)


def check_tensor_parallel(model_path: str, config) -> None:
    """vLLM splits attention heads over the group: say so now rather than after the models load."""
    from transformers import AutoConfig

    heads = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code),
                    "num_attention_heads", None)
    if heads and heads % config.vllm_tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"--vllm_tp {config.vllm_tp}: the model has {heads} attention heads, which tensor "
                          f"parallelism must divide; use one of {divisors}")
