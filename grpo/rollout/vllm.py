"""Colocated, in-process vLLM rollout engine (tested with vllm 0.26.0 on torch 2.11).

Every rank (or every group of `tensor_parallel_size` consecutive ranks) holds one engine on its own GPU(s), created
with `distributed_executor_backend="external_launcher"` inside the training processes. The engine sleeps while
DeepSpeed trains (level 1: KV cache freed, weights parked in CPU memory) and wakes for the next rollout; after every
optimizer step the trainer pushes the policy's weights with `load_weights` (weights woken first, then the KV cache).

With tensor parallelism every rank of a group must send the same prompts: generate() gathers the group's prompts,
the group generates them together, and each rank keeps its own completions.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, Optional

import torch

from ..errors import ConfigError
from .base import Completion, SamplingSettings

logger = logging.getLogger("grpo")
INSTALL_HINT = "--use_vllm_rollout needs vLLM: pip install .[vllm] (tested with vllm 0.26.0)"


def _import_vllm():
    # in-process engine core: the model must live in this process for load_weights to reach it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    return vllm


class VLLMRolloutEngine:
    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.3,
                 dtype: str = "bfloat16", max_model_len: int = 2048, seed: int = 0, enable_sleep: bool = True,
                 enforce_eager: bool = False, stop_token_ids: Optional[list[int]] = None):
        vllm = _import_vllm()
        self._vllm = vllm
        self.tp = tensor_parallel_size
        self.stop_token_ids = list(stop_token_ids or [])
        self.enable_sleep = enable_sleep
        self.llm = vllm.LLM(
            model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=enable_sleep, enforce_eager=enforce_eager, skip_tokenizer_init=True,
            distributed_executor_backend="external_launcher",
            # log-probs after temperature, like the trainer's softmax(logits / T)
            logprobs_mode="processed_logprobs")
        self._asleep: set[str] = set()
        self.last_sleep_freed_bytes = 0
        self._tp_group = self._make_tp_group()

    # -------------------------------------------------------------------------------------- generation
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSettings) -> list[Completion]:
        mine = len(prompt_token_ids)
        prompts, offset = self._gather_group_prompts(prompt_token_ids)
        params = self._vllm.SamplingParams(
            n=sampling.n, max_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p, logprobs=0, detokenize=False,
            stop_token_ids=self.stop_token_ids or None)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        completions = []
        for index, request in enumerate(outputs[offset:offset + mine]):
            for sample in request.outputs:
                ids = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids)]
                finish = "stop" if sample.finish_reason == "stop" else "length"
                completions.append(Completion(index, ids, logprobs, finish))
        return completions

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights (for checks and tests)."""
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        return [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], token_ids[1:])]

    # ----------------------------------------------------------------------------------------- weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])  # parked weights come back before they are overwritten
            self._asleep.discard("weights")
        tensors = list(named_tensors)
        self.llm.apply_model(lambda model: model.load_weights(tensors))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    # ------------------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if not self.enable_sleep or self._asleep:
            return
        before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=1)
        torch.cuda.synchronize()
        self.last_sleep_freed_bytes = torch.cuda.mem_get_info()[0] - before
        self._asleep = {"weights", "kv_cache"}
        logger.debug(f"vLLM asleep: {self.last_sleep_freed_bytes / 2**30:.2f} GiB GPU memory freed")

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()

    # --------------------------------------------------------------------------- tensor-parallel groups
    def _make_tp_group(self):
        if self.tp == 1 or not torch.distributed.is_initialized():
            return None
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        groups = [torch.distributed.new_group(list(range(s, s + self.tp))) for s in range(0, world, self.tp)]
        return groups[rank // self.tp]

    def _gather_group_prompts(self, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        """All prompts of this rank's TP group (in rank order) and where this rank's start."""
        if self._tp_group is None:
            return prompts, 0
        parts = [None] * self.tp
        torch.distributed.all_gather_object(parts, prompts, group=self._tp_group)
        local = torch.distributed.get_rank() % self.tp
        return [p for part in parts for p in part], sum(len(part) for part in parts[:local])
