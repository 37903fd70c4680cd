"""Tests that start ranks of their own (torch.multiprocessing), each process group on a port the OS reports free."""
import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(rank: int, port: int, world: int = 2) -> None:
    """The environment by which this process is rank `rank` of `world` (as DeepSpeed's launcher sets it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))


def end_rank() -> None:
    """End this rank once its work passed: the group ended together (as train_grpo.py does), then the process left
    without the interpreter's teardown, where gloo's worker threads can still abort it ("terminate called without
    an active exception") after every check passed. Only a rank that got here exits 0."""
    import sys

    from grpo.runtime.distributed import shutdown

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(rank, rank_main, port, *args) -> None:
    rank_main(rank, port, *args)
    end_rank()


def spawn_ranks(rank_main, *args, nprocs: int = 2) -> None:
    """rank_main(rank, port, *args) in `nprocs` processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    mp.spawn(_run_rank, args=(rank_main, free_port(), *args), nprocs=nprocs)
