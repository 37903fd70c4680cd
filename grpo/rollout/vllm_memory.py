"""What grpo reaches inside an in-process vLLM engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), tested with vllm 0.26.0:
its model runner, and a sleep that drops the KV cache alone.

vLLM's own sleep releases every allocation of its memory pool, the weights included (level 1 parks them in CPU
memory). When the trainer's base tensors are views of the engine's weights (grpo.sync.shared_base) those must stay,
so the engine sleeps by releasing the allocations tagged "kv_cache" only, and wakes them through the worker's own
wake-up for that tag (same addresses, so its CUDA graphs stay valid; the block tables rebuilt); what the cache held
is gone, as after vLLM's own sleep. Also what a sleep and a wake leave to memory: whether torch's cached blocks can
stay beside a wake, and the cap's loan of what the sleeping engine unmapped (grpo.runtime.gpu_budget).
"""
from __future__ import annotations

import gc

import torch

KV_CACHE_TAG = "kv_cache"  # the tag vLLM's worker allocates its KV cache under (vllm/v1/worker/gpu_worker.py)


def model_runner(llm):
    """The worker's model runner of an in-process engine."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def engine_model(llm) -> torch.nn.Module:
    """The model the engine runs (unwrapped from its CUDA-graph wrapper), with its LoRA layers if any."""
    return model_runner(llm).get_model()


def release_kv_cache(empty_torch_cache: bool = True) -> int:
    """Unmap the KV cache's GPU memory (the weights stay); the bytes released. `empty_torch_cache`: also hand the
    blocks torch's allocator keeps cached (the rollout's temporaries) back to the driver; the trainer's own
    allocations come from that cache anyway, so this is only needed where a cap on torch counts them."""
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    released = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == KV_CACHE_TAG and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True
            released += data.handle[1]
    if empty_torch_cache:
        gc.collect()
        torch.cuda.empty_cache()
    return released


# free memory a wake leaves beside torch's cached blocks, beyond what it maps: vLLM's own temporaries outside torch's
# cache, and the driver's granularity
WAKE_MARGIN_BYTES = 2**30


def room_beside_cache(free_bytes: int, mapped_bytes: int) -> bool:
    """Whether a wake that maps `mapped_bytes` fits in the driver's `free_bytes` with WAKE_MARGIN_BYTES to spare."""
    return free_bytes >= mapped_bytes + WAKE_MARGIN_BYTES


def lend_unmapped_to_cap(tags: set[str]) -> None:
    """Under --gpu_memory_gib, lend torch's cap what the engine's allocations with these tags unmapped (the cap still
    counts them: grpo.runtime.gpu_budget); nothing unmapped ends the loan. Nothing without a cap."""
    from grpo.runtime.gpu_budget import is_capped, lend_engine_memory

    if is_capped():
        lend_engine_memory(asleep_bytes(tags))


def asleep_bytes(tags: set[str]) -> int:
    """GPU bytes of the engine's released allocations with these tags: what waking them maps again."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return sum(data.handle[1] for data in CuMemAllocator.get_instance().pointer_to_data.values()
               if data.is_asleep and data.tag in tags)


def restore_kv_cache(llm) -> None:
    """Map the KV cache's memory again where it was, through the worker's own wake-up for that tag: it also rebuilds
    what lives in that memory besides the cache (the block tables' layout tensors)."""
    from vllm.device_allocator.cumem import CuMemAllocator

    if any(d.tag == KV_CACHE_TAG and d.is_asleep for d in CuMemAllocator.get_instance().pointer_to_data.values()):
        llm.llm_engine.model_executor.driver_worker.worker.wake_up(tags=[KV_CACHE_TAG])
