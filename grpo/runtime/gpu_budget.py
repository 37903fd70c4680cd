"""The job's GPU memory: torch's allocator settings, and --gpu_memory_gib, which runs within a smaller GPU's memory on a
larger one (e.g. a 24 GB card's budget on an 80 GB H100) to see what fits before buying or renting the card.

    torch      torch.cuda.set_per_process_memory_fraction(cap / total): the allocator refuses beyond the cap
    vLLM       its KV cache in bytes, as the memory plan sized it within the cap (grpo.memory); where the plan cannot
               size it (no plain per-token cache), its --vllm_gpu_memory_utilization share taken of the cap

vLLM's memory (weights, KV cache) comes from a pool of torch's allocator, which the cap counts. While the engine
sleeps, what it unmapped is back with the driver, as on a card of that size, but torch's count still holds it: that
much is lent to torch for the time (lend_engine_memory, raising the fraction; end_engine_loan before the engine maps
it again), so that the cap bounds what the process holds on the GPU and training may use the sleeping cache's memory
as it would on the card. (What torch still holds when the engine maps its memory again is the plan's to keep within
the cap: vLLM maps it outside torch's count.) The driver's figure for the whole process (benchmarks/memory_scale.sh) is
the one to compare with the card.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from grpo.errors import ConfigError

logger = logging.getLogger("grpo")


ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Let torch's allocator grow its segments in place (expandable_segments:True) unless the user chose either way
    in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF; whether it is now on. Without it, a step's micro-batches of
    different lengths leave reserved blocks that later requests do not fit: at Qwen2.5-7B's shape, qlora within
    --gpu_memory_gib 16, the first update ran out of memory with 2.66 GiB reserved and unused (benchmarks/RESULTS.md).
    vLLM 0.26 turns it off around its own memory pool (sleep mode), reading PYTORCH_CUDA_ALLOC_CONF, so that is
    where it is set too."""
    chosen = {name: os.environ.get(name, "") for name in ALLOC_CONF_VARIABLES}
    user_choice = [conf for conf in chosen.values() if "expandable_segments" in conf]
    if user_choice and not any("expandable_segments:True" in conf for conf in user_choice):
        return False
    conf = chosen["PYTORCH_CUDA_ALLOC_CONF"]
    if "expandable_segments" not in conf:  # (also where the user chose it in PYTORCH_ALLOC_CONF: vLLM reads this one)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    if not user_choice:
        settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
            torch.cuda.memory._set_allocator_settings
        settings("expandable_segments:True")  # the allocator may be running already
        logger.info("torch's GPU allocator grows its segments in place (PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True; set expandable_segments:False there to keep fixed segments)")
    return True


def gpu_total_bytes(device: Optional[torch.device] = None) -> int:
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return torch.cuda.get_device_properties(index).total_memory


def usable_gpu_bytes(cap_gib: Optional[float], device: Optional[torch.device] = None) -> int:
    """What the job may use of this rank's GPU: the cap, or the whole GPU."""
    total = gpu_total_bytes(device)
    return min(total, int(cap_gib * 2**30)) if cap_gib else total


def cap_gpu_memory(cap_gib: Optional[float], device: torch.device) -> None:
    """Hold torch's allocator to `cap_gib` on `device` (nothing without a cap or a GPU)."""
    if not cap_gib or device.type != "cuda":
        return
    total = gpu_total_bytes(device)
    if cap_gib * 2**30 > total:
        raise ConfigError(f"--gpu_memory_gib {cap_gib}: this GPU has {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, device)
    _caps[_index(device)] = [int(cap_gib * 2**30), 0]
    logger.info(f"GPU memory capped at {cap_gib:g} GiB of {total / 2**30:.1f} (--gpu_memory_gib)")


_caps: dict[int, list[int]] = {}  # device index -> [the cap in bytes, bytes lent to torch while the engine sleeps]


def _index(device: Optional[torch.device]) -> int:
    return torch.cuda.current_device() if device is None or device.index is None else device.index


def lend_engine_memory(nbytes: int, device: Optional[torch.device] = None) -> None:
    """The sleeping engine unmapped `nbytes` of its pool: torch's cap may count that much more until end_engine_loan
    (module docstring). Nothing without a cap."""
    cap = _caps.get(_index(device)) if _caps else None
    if cap is None:
        return
    if nbytes <= 0:  # nothing unmapped (any more): no loan
        end_engine_loan(device)
        return
    cap[1] = nbytes
    total = gpu_total_bytes(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, (cap[0] + nbytes) / total), _index(device))


def end_engine_loan(device: Optional[torch.device] = None) -> None:
    """Back to the cap itself, before the engine maps its memory again (and before torch's cached blocks are
    emptied for it: grpo.rollout.vllm)."""
    cap = _caps.get(_index(device)) if _caps else None
    if cap is None or not cap[1]:
        return
    cap[1] = 0
    torch.cuda.set_per_process_memory_fraction(cap[0] / gpu_total_bytes(device), _index(device))


def is_capped(device: Optional[torch.device] = None) -> bool:
    """Whether --gpu_memory_gib holds torch's allocator on this device."""
    return _index(device) in _caps if _caps else False


def engine_loan_bytes(device: Optional[torch.device] = None) -> int:
    """What is lent to torch's cap now (0 without a cap or with the engine awake)."""
    return _caps.get(_index(device), [0, 0])[1] if _caps else 0


def engine_memory_share(share: float, cap_gib: Optional[float]) -> float:
    """vLLM's gpu_memory_utilization (a share of the whole GPU) for `share` of what the job may use."""
    if not cap_gib or not torch.cuda.is_available():
        return share
    return share * usable_gpu_bytes(cap_gib) / gpu_total_bytes()
