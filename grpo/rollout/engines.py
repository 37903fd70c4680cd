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
from grpo.runtime.gpu_budget import engine_memory_share, least_gpu_memory
from grpo.rollout.hf import HFRolloutEngine, stop_token_ids
from grpo.rollout.kv_cache import engine_kv_cache_bytes
from grpo.sync.shared_base import park_frozen_base, restore_parked
from grpo.sync.weight_sync import converted_on_load

logger = logging.getLogger("grpo")
# --rollout_weights auto, qlora: the engine holds the 4-bit base plus the adapter once the merged 16-bit copy would
# take more than this share of the GPU. Below it both fit and merged is faster: on one H100 at Qwen2.5-7B's shape
# (a 15 GiB copy, 19% of the GPU) merged took 8.1 s/step with eager vLLM (26.4 GiB peak), adapter 8.5 s/step with
# CUDA graphs and 27.7 eager (19.0 GiB peak); at 0.68B with lora, 1.76 against 2.26 (benchmarks/RESULTS.md)
ADAPTER_FROM_SHARE = 0.4
# default --vllm_sleep_level, lora / qlora with merged weights on one GPU: the engine keeps its 16-bit copy through
# training (level 0: a sync writes the adapted layers in place) where the copy takes at most this share of the GPU;
# level 2 frees it. At Qwen2.5-7B's shape on one H100 (a 15 GiB copy, 19%), level 2's sync took 0.15-0.18 s
# (benchmarks/RESULTS.md)
KEEP_WEIGHTS_UP_TO_SHARE = 0.25
# --rollout_weights auto, lora: in_place (one 16-bit base) where its 16-bit copy takes IN_PLACE_FROM_BYTES or more, or
# more than KEEP_WEIGHTS_UP_TO_SHARE of the GPU; merged (kept through training) below both (8 GiB: 4.3B parameters). On
# one H100 at Qwen2.5-7B's shape (a 14.2 GiB copy), five runs in turn on one GPU: in_place 5.08-5.19 s/step (mean 5.15)
# at a 30.8 GiB peak, merged 5.11-5.21 (mean 5.16) at 43.3 GiB; its merge costs the rollout 0.025 s and its sync saves
# 0.016, within the steps' spread (benchmarks/RESULTS.md, 2026-11-27 10:00). At 0.68B (a 1.3 GiB copy) in_place took
# 0.05-0.15 s more of a 2.0 s step, its launches and waits weighing more there (03:50, before its kernels were retiled),
# so merged keeps small models; sizes between are not measured. Beyond the share a merged copy leaves the GPU at every
# sleep and comes back whole at every sync (0.15-0.18 s at 7B), so in_place is both smaller and faster there.
IN_PLACE_FROM_BYTES = 8 * 2**30


def engine_holds_weights(config) -> bool:
    """Whether the engine has weights of its own to sync (vLLM, or the rollout ranks of server mode); the colocated
    HF engine samples the live policy module."""
    return config.uses_vllm or config.rollout_mode == "server"


def engine_dtype(config, trainer_dtype: torch.dtype) -> torch.dtype:
    """What the engine computes in, so what the sync sends: vLLM bf16; an HF engine the trainer's own dtype."""
    return torch.bfloat16 if config.uses_vllm else trainer_dtype


def build_rollout_engine(config, model_path: str, policy, tokenizer, vision, rank: int, trainer_dtype: torch.dtype,
                         completion_tokens: int | None = None, episode_datasets: list[str] | None = None):
    """Server mode: the rollout ranks, reached through RemoteRolloutEngine; otherwise a colocated vLLM engine, or
    the HF engine over the policy module itself. `completion_tokens`: the longest completion (a multi-turn
    episode's budget), which a colocated engine's KV cache is sized for. `episode_datasets`: the datasets whose rows
    run as episodes, which server mode's rollout ranks run."""
    stops = stop_token_ids(policy, tokenizer)
    weights = engine_weights(config, policy, vision, model_path) if config.uses_vllm else "merged"
    adapter, in_place = weights == "adapter", weights == "in_place"
    lora_rank = adapter_rank(policy) if adapter else None
    if config.rollout_mode == "server":
        from grpo.rollout.remote import RemoteRolloutEngine
        from grpo.runtime import distributed as dist_utils

        spec = dict(dtype=str(engine_dtype(config, trainer_dtype)).removeprefix("torch."), stop_token_ids=stops,
                    max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                    image_token_id=vision.image_token_id if vision else None,
                    suppress_token_ids=vision.placeholder_token_ids if vision else None, lora_rank=lora_rank,
                    episode_datasets=list(episode_datasets or []))
        logger.info(f"waiting for {config.rollout_gpus} rollout rank(s) to start their engines")
        # qlora: the rollout ranks load training rank 0's 4-bit base from a folder in --output_dir, which they
        # must see (on another node: shared storage); it goes once their engines hold the weights
        writes = adapter and config.tuning_strategy == "qlora" and dist_utils.is_main()
        with _engine_base(config, policy, model_path if writes else None, config.output_dir,
                          keep=vision is not None) as base:
            if base is not None:
                spec.update(model_path=base, quantized=True)
            return RemoteRolloutEngine(spec, config.rollout_gpus, config.ddp_timeout_minutes,
                                       images_as_decoded=config.uses_vllm)
    if config.uses_vllm:
        quantized = adapter and config.tuning_strategy == "qlora"
        # adapter: the engine loads the trainer's own base (lora: the same 16-bit checkpoint; qlora: the trainer's 4-bit
        # base, written for it), while the trainer's waits in CPU memory; then the trainer's views the engine's
        # vLLM keeps weights, not files (but a vision-language engine's processor files: kept)
        with _engine_base(config, policy, model_path if quantized else None, keep=vision is not None) as base:
            parked = park_frozen_base(policy) if (adapter or in_place) and config.vllm_tp == 1 else {}
            try:
                engine = _vllm_engine(config, base or model_path, rank, vision, stops, lora_rank=lora_rank,
                                      quantized=quantized, completion_tokens=completion_tokens,
                                      sleep_level=engine_sleep_level(config, policy, adapter),
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
    return HFRolloutEngine(policy, tokenizer, suppress_token_ids=vision.placeholder_token_ids if vision else None)


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


def engine_weights(config, policy, vision, model_path: str | None = None) -> str:
    """--rollout_weights for this model: "in_place", "adapter" or "merged". auto takes in_place for lora where it
    can, else falls back as adapter does; adapter falls back to merged, said once, where vLLM's LoRA cannot take
    the adapter; an explicit choice that cannot be is an error. A checkpoint saved in 4 bits has no 16-bit weights
    for a merged engine to start from: adapter."""
    choice = config.engine_weights
    if choice == "in_place":
        why = _in_place_refusal(policy, vision)
        if why is None:
            copy_bytes, gpu_bytes = copy_and_gpu_bytes(config, policy)
            if (config.rollout_weights == "auto" and copy_bytes < IN_PLACE_FROM_BYTES
                    and copy_bytes <= KEEP_WEIGHTS_UP_TO_SHARE * gpu_bytes):
                logger.info(f"vLLM takes merged weights: their 16-bit copy ({copy_bytes / 2**30:.1f} GiB) fits "
                            f"{KEEP_WEIGHTS_UP_TO_SHARE:.0%} of the GPU's {gpu_bytes / 2**30:.0f} GiB, and at this "
                            "size merged is a little faster (--rollout_weights auto; in_place holds the base once)")
                return "merged"
            logger.info("vLLM holds the base once, shared with the trainer; each rollout merges the adapter into it "
                        f"and takes it out after (--rollout_weights {config.rollout_weights})")
            return "in_place"
        if config.rollout_weights == "in_place":
            raise ConfigError(f"--rollout_weights in_place merges one plain LoRA adapter into the shared base, which "
                              f"cannot take {why}: use --rollout_weights merged")
        choice = "adapter"  # auto: as for qlora
    stored_4bit = model_path is not None and config.tuning_strategy == "qlora" and bool(saved_4bit(model_path))
    if stored_4bit:
        if config.rollout_weights == "merged":
            raise ConfigError(f"--rollout_weights merged starts vLLM from the 16-bit checkpoint, and {model_path} is "
                              "saved in 4 bits: use --rollout_weights adapter (or auto)")
        if config.vllm_tp > 1:
            raise ConfigError(f"{model_path} is saved in 4 bits, which vLLM 0.26 loads on one GPU per engine only: "
                              "use --vllm_tp 1")
        choice = "adapter"
    if choice != "adapter":
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
    if config.rollout_weights == "auto" and not stored_4bit:
        copy_bytes, gpu_bytes = copy_and_gpu_bytes(config, policy)
        if copy_bytes <= ADAPTER_FROM_SHARE * gpu_bytes:
            logger.info(f"vLLM takes merged weights: their 16-bit copy ({copy_bytes / 2**30:.1f} GiB) fits "
                        f"{ADAPTER_FROM_SHARE:.0%} of the GPU's {gpu_bytes / 2**30:.0f} GiB, and merged generates "
                        "faster (--rollout_weights auto; adapter holds the 4-bit base instead)")
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
    split = _fused_parts_left_16bit(config) if config.tuning_strategy == "qlora" and not stored_4bit else None
    if split:
        return split
    if getattr(getattr(policy, "config", None), "kv_lora_rank", None):
        # measured on a DeepSeek-V2 shape (H200, 2026-11-27): vLLM's LoRA scored 0.38-0.76 nats off the policy
        return "MLA attention (DeepSeek-V2/V3)"
    fused = _fused_on_load(policy)
    if fused:
        return fused
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


def gpu_memory_bytes(cap_gib=None) -> int:
    """What the job may use of this rank's GPU (--gpu_memory_gib, or all of it)."""
    from grpo.runtime.gpu_budget import usable_gpu_bytes

    return usable_gpu_bytes(cap_gib)


def copy_and_gpu_bytes(config, policy) -> tuple[int, int]:
    """The bytes of a 16-bit copy of the policy (what a merged engine holds) and of the GPU the job may use: what
    auto's rules weigh."""
    from grpo.model.loading import parameter_count

    return 2 * parameter_count(policy), gpu_memory_bytes(config.gpu_memory_gib)


def engine_sleep_level(config, policy, adapter: bool) -> int:
    """--vllm_sleep_level, or its default: 0 (the KV cache alone) for lora / qlora with merged weights on one GPU
    whose 16-bit copy takes at most KEEP_WEIGHTS_UP_TO_SHARE of it, as the trainer's own memory is small there and a
    sync then writes the adapted layers alone; 2 otherwise (full fine-tuning needs the memory; an adapter engine
    keeps its base anyway)."""
    if config.vllm_sleep_level is not None:
        return config.vllm_sleep_level
    if adapter or config.tuning_strategy not in ("lora", "qlora") or config.vllm_tp > 1:
        return 2
    copy_bytes, gpu_bytes = copy_and_gpu_bytes(config, policy)
    return 0 if copy_bytes <= KEEP_WEIGHTS_UP_TO_SHARE * gpu_bytes else 2


def adapter_rank(policy) -> int:
    """The largest LoRA rank of the policy (rank patterns included): what the engine's LoRA slots must hold."""
    peft_config = policy.peft_config["default"]
    return max([peft_config.r, *(peft_config.rank_pattern or {}).values()])


def _vllm_engine(config, model_path: str, rank: int, vision, stops, lora_rank: int | None = None,
                 quantized: bool = False, completion_tokens: int | None = None, sleep_level: int = 2,
                 merge_in_place: bool = False):
    from grpo.rollout.vllm import VLLMRolloutEngine

    free, total = least_gpu_memory()  # every rank sizes its KV cache alike
    # ranks of one tensor-parallel group share a seed: they must sample the same completions
    return VLLMRolloutEngine(model_path, tensor_parallel_size=config.vllm_tp,
                                 gpu_memory_utilization=engine_memory_share(config.vllm_memory_share,
                                                                            config.gpu_memory_gib),
                                 kv_cache_bytes=engine_kv_cache_bytes(config, model_path, gpu_total_bytes=total,
                                                                      gpu_free_bytes=free,
                                                                      completion_tokens=completion_tokens),
                                 max_model_len=config.max_seq_length, seed=config.seed + rank // config.vllm_tp,
                                 enable_sleep=config.vllm_sleep,
                                 sleep_level=sleep_level, enforce_eager=config.vllm_enforce_eager,
                                 stop_token_ids=stops,
                                 max_images_per_prompt=config.max_images_per_prompt if vision else 0,
                                 image_token_id=vision.image_token_id if vision else None,
                                 lora_rank=lora_rank, quantized=quantized, merge_in_place=merge_in_place,
                                 # a cap on torch counts its cached blocks: hand them back at every sleep and wake
                                 keep_torch_cache=config.gpu_memory_gib is None)


def check_tensor_parallel(model_path: str, config) -> None:
    """vLLM splits attention heads over the group: say so now rather than after the models load."""
    from transformers import AutoConfig

    heads = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code),
                    "num_attention_heads", None)
    if heads and heads % config.vllm_tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ConfigError(f"--vllm_tp {config.vllm_tp}: the model has {heads} attention heads, which tensor "
                          f"parallelism must divide; use one of {divisors}")
