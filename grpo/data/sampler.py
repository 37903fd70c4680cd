"""Which prompts each rank trains on: a seeded shuffle per epoch, split across ranks, resumable by position."""
from __future__ import annotations

import torch


class PromptOrder:
    """Like torch's DistributedSampler (shuffle, drop_last), but addressable by (epoch, position).

    Epoch e uses a permutation seeded by seed + e; rank r takes every world-th index starting at r. Steps take
    consecutive slices of `per_step` indices from the rank's share; a share's remainder shorter than a step is
    dropped. Because the order is a pure function of (seed, epoch, rank), resuming needs only epoch and position.
    """

    def __init__(self, num_rows: int, per_step: int, seed: int, rank: int, world: int):
        self.num_rows, self.per_step, self.seed, self.rank, self.world = num_rows, per_step, seed, rank, world
        self.share = num_rows // world
        self.steps_per_epoch = self.share // per_step

    def indices(self, epoch: int, position: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_rows, generator=gen)[: self.share * self.world]
        mine = perm[self.rank::self.world].tolist()
        return mine[position:position + self.per_step]

    def next(self, epoch: int, position: int) -> tuple[list[int], int, int]:
        """Indices of the next step and the (epoch, position) after it."""
        if position + self.per_step > self.steps_per_epoch * self.per_step:
            epoch, position = epoch + 1, 0
        return self.indices(epoch, position), epoch, position + self.per_step
