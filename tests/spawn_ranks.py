"""Tests that start ranks of their own (torch.multiprocessing), each process group on a port the OS reports free."""
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(rank_main, *args, nprocs: int = 2) -> None:
    """rank_main(rank, port, *args) in `nprocs` processes; raises if any of them fails."""
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(free_port(), *args), nprocs=nprocs)
