"""Distributed: the DeepSpeed config, the launcher's rank, this run's GPU memory budget and the memory plan alone
(--plan_only), the process group's timeout, and the checks of those options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config.sections.option import need, option


@dataclass
class DistributedOptions:
    deepspeed: str = option("zero2", "DeepSpeed config file, or 'zero2' / 'zero3' for the shipped ones (a relative "
                                   "configs/ path missing from the current folder is read from the package's).",
                          "distributed")
    local_rank: int = option(-1, "Set by the deepspeed launcher; leave alone.", "distributed")
    gpu_memory_gib: Optional[float] = option(
        None, "This run's budget on each GPU, e.g. 24 to try a 24 GB card on a larger GPU (memory other processes "
              "hold lowers what is free, not this budget). The memory plan fits the run within it (docs/memory.md); "
              "with --plan_only on a machine without a GPU it names the card to plan for.", "training")
    plan_only: bool = option(
        False, "Print the memory plan of the run these flags describe (each phase's peak, the automatic choices, "
               "what to change where it does not fit) and exit, loading no weights: in seconds, with or without a "
               "GPU (then for the card --gpu_memory_gib names).", "training")
    ddp_timeout_minutes: float = option(
        30.0, "How long a collective waits for a rank that never arrives before the run stops with an error "
        "(the process-group timeout).", "distributed")

    def check_distributed(self) -> None:
        need(self.gpu_memory_gib is None or self.gpu_memory_gib > 0, "gpu_memory_gib", "must be > 0 (GiB)")
        need(self.ddp_timeout_minutes > 0, "ddp_timeout_minutes",
             f"must be > 0 (minutes; got {self.ddp_timeout_minutes}); raise it when one step (a long rollout, "
             f"a large checkpoint save) can keep some ranks waiting longer than that")
