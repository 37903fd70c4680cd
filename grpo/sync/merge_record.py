"""The in-place merge's record of one layer, and the constants its two implementations share: the torch equations
(grpo.sync.in_place_merge) and the Triton kernels (grpo.sync.merge_kernel) write the same 2-bit codes and keep the
same escaped elements beside them, so an unmerge gives W back bit for bit whichever ran (the equations are in
in_place_merge's docstring).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ESCAPE = 3                  # the code of an element whose W is kept beside the codes (or was left unmerged)
CODES_PER_BYTE = 4          # 2 bits each, the first element in the lowest bits
FIRST_ESCAPE_SHARE = 1 / 256  # a layer's first escape buffer, per element (0.4%); misses of more than one step
                              # took 0.01-0.5% of a Qwen2.5-7B-like layer's elements with |B| of 1e-4 to 1e-2 (rank
                              # 16), and grow with |s B A| / |W|: a layer that needs more gets it
                              # (grpo.sync.in_place_merge.InPlaceMerge.merge)
KERNEL_MAX_RANK = 64         # the Triton kernels' largest rank (grpo.sync.merge_kernel.MAX_RANK is this)
BITS_OF = {2: torch.int16, 4: torch.int32}  # a weight's element size -> the integer type of its bit pattern


@dataclass
class LayerRecord:
    """What a merge of one layer keeps for its unmerge."""
    codes: torch.Tensor                   # uint8, 4 codes a byte (torch: [numel / 4]; the kernel: its own layout)
    escape_index: torch.Tensor            # int32 [capacity]: flat positions of the kept elements
    escape_bits: torch.Tensor             # [capacity], W's bit pattern at those positions
    escapes: int = 0                      # how many of them hold an element (after a merge)
    counter: Optional[torch.Tensor] = None  # the kernel's escape count (int32 [1]; may pass the capacity)
    needed: int = 0                       # escapes of the last kernel merge, room or not


def restore_escapes(weight: torch.Tensor, record: LayerRecord) -> None:
    """The kept elements' W back in place (the last step of an unmerge)."""
    if record.escapes:
        flat = weight.view(BITS_OF[weight.element_size()]).reshape(-1)
        flat[record.escape_index[:record.escapes].long()] = record.escape_bits[:record.escapes]
