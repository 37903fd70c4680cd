"""The experts a mixture of experts routes each token to while Hugging Face `generate` runs: forward hooks on its
routers collect every forward's choice (the prompt's prefill, then one column per decoding step), laid out as vLLM
returns them (`CompletionOutput.routed_experts`, vLLM 0.26): per sequence [prompt + completion tokens - 1, layers,
top_k], the last sampled token left out, as no forward reads it."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from grpo.model.routing_replay import NOT_RECORDED, ROUTING_DTYPE, find_routers


class RoutingRecord:
    """Every forward's routing of `rows` sequences; `columns()` lays them end to end."""

    def __init__(self, rows: int, layers: int, top_k: int):
        self.rows, self.layers, self.top_k = rows, layers, top_k
        self._forwards: list[dict[int, torch.Tensor]] = []  # per forward: layer -> [rows, tokens, k]

    def hook(self, layer: int):
        def record(module, inputs, output):
            experts = output[2]                                                      # [rows x tokens, k]
            if not self._forwards or layer in self._forwards[-1]:
                self._forwards.append({})  # the first router of a new forward
            # kept where it was computed: one copy per layer at the end, not one per layer and decoding step
            self._forwards[-1][layer] = experts.detach().to(ROUTING_DTYPE).view(self.rows, -1, self.top_k)
        return record

    def columns(self) -> torch.Tensor:
        """[rows, tokens fed, layers, k] on the CPU: every forward's tokens in order, NOT_RECORDED in layers without a
        router."""
        if not self._forwards:
            return torch.full((self.rows, 0, self.layers, self.top_k), NOT_RECORDED, dtype=ROUTING_DTYPE)
        tokens = sum(next(iter(forward.values())).shape[1] for forward in self._forwards)
        out = torch.full((self.rows, tokens, self.layers, self.top_k), NOT_RECORDED, dtype=ROUTING_DTYPE)
        for layer in self._forwards[0]:  # every forward runs every router
            out[:, :, layer] = torch.cat([forward[layer] for forward in self._forwards], dim=1).cpu()
        return out


@contextmanager
def recorded_routing(model: torch.nn.Module, rows: int, layers: int, top_k: int):
    """Inside, every forward of `model` over `rows` sequences adds its routing to the yielded RoutingRecord."""
    record = RoutingRecord(rows, layers, top_k)
    handles = [router.module.register_forward_hook(record.hook(router.layer)) for router in find_routers(model)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def sequence_routing(columns: torch.Tensor, row: int, prompt_start: int, completion_start: int,
                     completion_tokens: int) -> torch.Tensor:
    """One sequence's routing from a left-padded generate's columns [rows, width + steps - 1, layers, k]: its prompt
    (columns prompt_start .. completion_start - 1), then its completion's tokens but the last  # [P + C - 1, layers, k]."""
    end = completion_start + max(completion_tokens - 1, 0)
    return columns[row, prompt_start:end].clone()
