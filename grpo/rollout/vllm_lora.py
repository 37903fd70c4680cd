"""Handing the trained LoRA adapter to an in-process vLLM engine as tensors (tested with vllm 0.26.0).

vLLM's public LoRA path reads an adapter folder for each new `LoRARequest`. The colocated engine lives in this
process, so the adapter goes straight to the worker's LoRA manager instead, with no file per step:

    LoRAModel.from_lora_tensors(id, tensors, PEFTHelper)   the adapter, packed per fused layer (qkv, gate_up)
    manager.remove_adapter(id); add_adapter; activate      copied into the GPU slots the LoRA kernels read
    llm.generate(..., lora_request=LoRARequest(id))        the id is registered, so the request's path is never read

The tensors come with lora_B already scaled (grpo.sync.weight_sync.iter_adapter_tensors), so the helper's own
scale is 1 (lora_alpha = r). vLLM 0.26's ranks: max_lora_rank must be one of LORA_RANKS.

Names are the checkpoint's; the model's own mapper (hf_to_vllm_mapper, without its stacked part) renames them as
vLLM's loader does. For Qwen2-VL / Qwen2.5-VL that is model.layers.* -> language_model.model.layers.*, where vLLM
wraps the language model's layers alone (docs/vision.md): an adapter on the vision tower is refused before the
engine starts (grpo.rollout.engines), and any module vLLM has no layer for stops the sync here.
"""
from __future__ import annotations

import torch

from grpo.errors import ConfigError

ADAPTER_ID = 1
ADAPTER_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py's MaxLoRARanks


def engine_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank` (its kernels run at that width)."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"--lora_rank {rank}: vLLM's LoRA takes ranks up to {LORA_RANKS[-1]}; lower it or use "
                      "--rollout_weights merged")


def lora_manager(llm):
    """The worker's LoRA manager of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from grpo.rollout.vllm_memory import model_runner

    return model_runner(llm).lora_manager


def lora_request():
    """The request naming the adapter; its path is a label: the adapter is registered in memory under ADAPTER_ID
    before any request names it."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, "/in-memory/grpo-policy")


def load_adapter_tensors(llm, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the engine's adapter by `tensors` (peft names, lora_B scaled) and make it the active one."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker_manager = lora_manager(llm)
    models = worker_manager._adapter_manager
    rank = max(t.shape[0] for name, t in tensors.items() if name.endswith(".lora_A.weight"))
    modules = sorted({name.rsplit(".", 3)[0].rsplit(".", 1)[-1] for name in tensors})
    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": modules})
    helper.validate_legal(worker_manager.lora_config)
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    dtype = worker_manager.lora_config.lora_dtype
    adapter = LoRAModel.from_lora_tensors(
        ADAPTER_ID, {name: t.detach().clone() for name, t in tensors.items()}, helper,  # vLLM scales lora_B in place
        device="cuda", dtype=dtype if isinstance(dtype, torch.dtype) else None,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper.get_unstacked_mapper() if hasattr(mapper, "get_unstacked_mapper") else mapper)
    _check_every_module_is_known(adapter, models)
    models.remove_adapter(ADAPTER_ID)
    models.add_adapter(adapter)
    models.activate_adapter(ADAPTER_ID)


def _check_every_module_is_known(adapter, models) -> None:
    """vLLM skips an adapter module it has no layer for, silently: the engine would sample another policy."""
    known = set(models.modules)
    for fused, parts in getattr(models, "packed_modules", {}).items():
        known.update(parts)
    unknown = sorted(name for name in adapter.loras if name not in known)
    if unknown:
        raise ConfigError(f"vLLM's LoRA has no layer for {', '.join(unknown[:4])}"
                          f"{' ...' if len(unknown) > 4 else ''}: train without those layers in "
                          "--lora_target_modules, or use --rollout_weights merged")
