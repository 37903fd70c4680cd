"""Which part of the job a process plays: with --rollout_mode server the last --rollout_gpus ranks generate, the others
train. The launcher's RANK / WORLD_SIZE describe the whole job; the training ranks then form a torch.distributed
world of their own (so DeepSpeed and every collective of the trainer see only them), and so do the rollout ranks
(vLLM's tensor-parallel groups live there). The job-wide values are kept before either world starts
(grpo/config/job.py, where the options are checked against them).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from grpo.config.job import job_rank, job_world_size, keep_job


def training_ranks(rollout_ranks: int) -> int:
    return job_world_size() - rollout_ranks


def rollout_index(rollout_ranks: int) -> Optional[int]:
    """This process's place among the rollout ranks (0..rollout_ranks-1), or None for a training rank."""
    first = training_ranks(rollout_ranks)
    return job_rank() - first if rollout_ranks and job_rank() >= first else None


def enter_training_world(rollout_ranks: int) -> None:
    """Before the process group starts on a training rank: its world is the job's first ranks only."""
    if rollout_ranks and keep_job():
        os.environ["WORLD_SIZE"] = str(training_ranks(rollout_ranks))


def launcher_rank_and_world() -> tuple[int, int]:
    """This training rank and the training world's size before the process group starts (it takes them from the
    same RANK / WORLD_SIZE), or the group's own where one already runs (a notebook that started it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rollout_ranks_of(config) -> int:
    return config.rollout_gpus if config.rollout_mode == "server" else 0


def check_node_layout(config) -> None:
    """With several nodes, a vLLM tensor-parallel group must lie within one node (its ranks talk at every layer):
    refused before any model loads otherwise. Reads the launcher's LOCAL_SIZE (ranks per node)."""
    tp = getattr(config, "vllm_tp", 1)
    if tp <= 1 or not config.uses_vllm:
        return
    from grpo.errors import ConfigError
    from grpo.runtime.distributed import local_world_size, node_count  # (torch: only for a tensor-parallel vLLM)

    if node_count() < 2:
        return
    per_node = local_world_size()
    first = training_ranks(rollout_ranks_of(config)) if rollout_ranks_of(config) else 0
    if per_node % tp or first % tp:
        raise ConfigError(f"--vllm_tp {tp}: with {per_node} rank(s) per node"
                          + (f" and the rollout ranks starting at job rank {first}" if first else "")
                          + ", a tensor-parallel group would span two nodes; give a --vllm_tp that divides the ranks "
                          "per node" + (" and the training ranks' count (--rollout_gpus)" if first else ""))
