"""The start-up check that every rank sees the same --output_dir.

Checkpoints are written by every rank into one folder and renamed into place by rank 0, rank 0 writes the final
model, failure records of one rank are read by the others: all of it needs one folder that every node sees (a shared
file system mounted at the same path). Rank 0 writes a token file there; after a barrier every rank reads it and the
answers are gathered, so that every rank raises the same error naming the nodes that do not see it, before any model
loads.
"""
from __future__ import annotations

import os
import socket
import uuid

from grpo.errors import ConfigError
from grpo.runtime import distributed as dist_utils

TOKEN_FILE = ".grpo_shared_check"


def check_shared_output_dir(output_dir: str) -> None:
    """Raise a ConfigError on every rank when some rank does not see rank 0's --output_dir. Collective."""
    if dist_utils.world_size() == 1:
        return
    token = dist_utils.broadcast_object(uuid.uuid4().hex if dist_utils.is_main() else None)
    path = os.path.join(output_dir, TOKEN_FILE)
    if dist_utils.is_main():
        with open(path, "w") as fh:
            fh.write(token)
    dist_utils.barrier()
    views = dist_utils.gather_objects((_sees(path, token), dist_utils.rank(), dist_utils.node_rank(),
                                       socket.gethostname()))
    dist_utils.barrier()  # every rank has read it
    if dist_utils.is_main():
        os.remove(path)
    blind = sorted({(node, host) for sees, _, node, host in views if not sees})
    if blind:
        raise ConfigError(shared_output_message(output_dir, views))


def _sees(path: str, token: str) -> bool:
    try:
        with open(path) as fh:
            return fh.read() == token
    except OSError:
        return False


def shared_output_message(output_dir: str, views: list) -> str:
    """The error for `views`: per rank (sees rank 0's file, rank, node rank, host name)."""
    blind: dict = {}
    for sees, rank, node, host in views:
        if not sees:
            blind.setdefault((node, host), []).append(rank)
    nodes = "; ".join(f"{dist_utils.node_label(node, host)} (rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))})" for (node, host), ranks in sorted(blind.items()))
    return (f"--output_dir {output_dir} is not shared: {nodes} do{'es' if len(blind) == 1 else ''} not see the "
            f"file rank 0 ({dist_utils.node_label(views[0][2], views[0][3])}) wrote there. Every node must see the "
            f"same output folder: put --output_dir on a shared file system (NFS, Lustre, ...) mounted at the same "
            f"path on every node (see docs/multinode.md)")
