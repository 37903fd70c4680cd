"""Process-group setup and small collective helpers.

DeepSpeed is the only training path, also for a single process started without a launcher (a notebook):
the environment variables a launcher would set get defaults here, so both share one code path.
"""
from __future__ import annotations

import glob
import logging
import os
import random
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from grpo.runtime.cpu_threads import size_thread_pools

logger = logging.getLogger("grpo")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the launcher variables init_distributed filled in (no launcher: a notebook), forgotten when the group ends, so that
# the next group gets a port of its own
_filled: dict[str, str] = {}


def init_distributed(timeout_minutes: float = 30.0) -> bool:
    """Start the process group (nccl on GPU, gloo on CPU) once; fill launcher variables when absent. True where this
    call started it (its caller ends it: shutdown()), False where one was running already.

    `timeout_minutes` bounds how long a collective waits for a rank that never arrives (--ddp_timeout_minutes).
    """
    if dist.is_available() and dist.is_initialized():
        return False
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        if name not in os.environ:
            os.environ[name] = _filled[name] = value
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _filled["MASTER_PORT"] = str(_free_port())
    if not torch.cuda.is_available():  # told, DeepSpeed does not warn that it fell back to its CPU accelerator
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    size_thread_pools()  # several ranks on one host share its cores
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    else:
        _prepare_cpu_comm_op(int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return True


def _prepare_cpu_comm_op(world: int) -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce op the first time it starts (a minute or more, then
    cached). A single process has nothing to reduce, so it goes without; several ranks say once that it builds."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    compatible = deepspeed.ops.__compatible_ops__
    if builder is None or not compatible.get(builder.NAME, False):
        return  # DeepSpeed will not build it
    if world == 1:
        compatible[builder.NAME] = False  # DeepSpeed's own "not usable here": its process group runs without it
        return
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get(builder.NAME):
        return  # compiled at install time
    folder = _get_build_directory(builder.name, verbose=False)
    if not glob.glob(os.path.join(folder, f"{builder.name}*.so")):  # only rank 0 logs INFO
        logger.info(f"building DeepSpeed's CPU communication op once (about a minute), cached in {folder}")


def shutdown() -> None:
    """End the process group once every rank is done: a rank that exits while a peer still holds a connection
    (rank 0 writing the final model) can abort in the communication library's teardown."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        comm = sys.modules.get("deepspeed.comm")
        if comm is not None and comm.is_initialized():
            comm.destroy_process_group()  # also DeepSpeed's own references to the groups (the next engine's anew)
        else:
            dist.destroy_process_group()
    for name, value in list(_filled.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
        del _filled[name]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


# ------------------------------------------------------------------------------------------------------ nodes
# DeepSpeed's launcher gives each rank CROSS_RANK / CROSS_SIZE (its node and the node count) and LOCAL_SIZE (ranks on
# its node); torchrun says GROUP_RANK / LOCAL_WORLD_SIZE. Without a launcher: one node.
def node_rank() -> int:
    """This process's node (0 for the node of rank 0)."""
    for name in ("CROSS_RANK", "GROUP_RANK", "NODE_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def node_count() -> int:
    for name in ("CROSS_SIZE", "NNODES"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def local_world_size() -> int:
    """Ranks on this node (the launcher's LOCAL_SIZE / LOCAL_WORLD_SIZE), else every rank."""
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return world_size()


def is_local_main() -> bool:
    """The first rank of its node: the one that does a node's own work (a node-local cache, a node-local file)."""
    return local_rank() == 0


def node_label(node: int | None = None, host: str | None = None) -> str:
    """"node 1, host gpu-b": how messages name a node (this process's by default)."""
    node = node_rank() if node is None else node
    return f"node {node}, host {host or socket.gethostname()}"


def device() -> torch.device:
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _reduce(values: torch.Tensor, op) -> torch.Tensor:
    if world_size() > 1:
        # gloo reduces CPU tensors, nccl GPU tensors
        values = values.to(device())
        dist.all_reduce(values, op=op)
    return values.cpu()


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum of a list of floats over ranks (float64 so counts stay exact)."""
    return _reduce(torch.tensor(values, dtype=torch.float64), dist.ReduceOp.SUM).tolist()


def all_max(values: list[float]) -> list[float]:
    return _reduce(torch.tensor(values, dtype=torch.float64), dist.ReduceOp.MAX).tolist()


def any_rank(flag: bool) -> bool:
    """True when the flag is set on any rank (all ranks must call it together)."""
    return all_max([1.0 if flag else 0.0])[0] > 0


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter_objects(per_rank: list | None):
    """Rank 0 holds one object per rank (`per_rank`, None elsewhere); each rank gets its own."""
    if world_size() == 1:
        return per_rank[0]
    out = [None]
    dist.scatter_object_list(out, per_rank if is_main() else None, src=0)
    return out[0]


# ---------------------------------------------------------------------------------------------------- seeding
def seed_everything(seed: int) -> None:
    """One seed for every random number generator a rank uses."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
