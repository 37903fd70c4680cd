"""CPU threads: as many as the cores this process may use, and idle threads that give their core back.

torch's OpenMP threads spin while they wait for the next parallel region (libgomp's default). Alone on its cores a
run loses nothing by it; beside another busy process the spinning threads take the time slices the working ones
need, and every small operation of HF generate waits on them: a 2-core run's rollout went from 5 s to 698 s beside
one other job. Waiting passively (OMP_WAIT_POLICY=PASSIVE) lets a shared CPU slow a run in proportion to its share.

libgomp reads its environment when torch loads, so `wait_passively` runs when `grpo` is imported; the pool's size
is set when the process group starts. A value the user (or the launcher) set is kept.
"""
from __future__ import annotations

import math
import os
from typing import Optional


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container's --cpus)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """CPUs' worth of time the cgroup may use per period, or None without a limit (cgroup v2, then v1)."""
    try:
        with open(os.path.join(root, "cpu.max")) as fh:  # "<quota> <period>", or "max <period>"
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as fh:
            quota = int(fh.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as fh:
            period = int(fh.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def threads_per_rank() -> int:
    """The available cores shared among the ranks the launcher started on this host (torchrun's LOCAL_WORLD_SIZE,
    DeepSpeed's LOCAL_SIZE: the ranks of this node, not of the job)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    return max(1, available_cores() // max(1, int(local)))


def wait_passively() -> None:
    """OpenMP threads sleep while they wait, unless OMP_WAIT_POLICY is set. Only takes effect before torch loads."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def size_thread_pools() -> int:
    """torch's intra-op pool (OpenMP and MKL) holds threads_per_rank() threads, unless OMP_NUM_THREADS is set.
    Returns the pool's size."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank())
    return torch.get_num_threads()
