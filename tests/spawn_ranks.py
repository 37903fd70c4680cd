"""Tests that start ranks of their own (torch.multiprocessing), each process group on a port the OS reports free."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank, rank_main, port, *args) -> None:
    import torch.distributed as dist

    rank_main(rank, port, *args)
    # Left to the interpreter's exit, gloo's threads are torn down in no set order and a rank can abort
    # ("terminate called without an active exception") after its work passed: end the group here, together.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def spawn_ranks(rank_main, *args, nprocs: int = 2) -> None:
    """rank_main(rank, port, *args) in `nprocs` processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    mp.spawn(_run_rank, args=(rank_main, free_port(), *args), nprocs=nprocs)
