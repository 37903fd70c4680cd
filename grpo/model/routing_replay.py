"""Routing replay for mixtures of experts: the trainer's MoE blocks send each token to the experts the rollout engine
routed it to, while the gate weights come from the trainer's own router (so the router keeps its gradient).

An MoE router (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) computes, per token,

    p = softmax(x W_r^T)                              # [tokens, experts], in fp32
    S = top-k(p)                                      # the k experts the token goes to
    w_e = p_e / sum_{j in S} p_j   (e in S)           # renormalised (Mixtral always; the Qwen / OLMoE families when
                                                      # config.norm_topk_prob), else w_e = p_e
    y = sum_{e in S} w_e MLP_e(x)

Tiny numeric differences between the engine and the trainer flip some of those top-k choices, and the trainer then
scores tokens through experts that never produced them. Under replay S is the engine's set (recorded per token and
layer), w is computed from the trainer's p at those experts, as above: the outputs are the engine's routing with the
trainer's weights, and d(loss)/d(W_r) flows through w.

Routing arrays hold, per token of a sequence (prompt, then completion), per decoder layer, the k experts:
[tokens, layers, k] int, -1 where nothing was recorded (the last token, which no forward of the engine routes; padding;
a dense layer). A token without a record keeps the trainer's own choice.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

# model_type -> whether its router renormalises the top-k probabilities: True always, or the config attribute saying so
REPLAYABLE_FAMILIES = {"mixtral": True, "qwen2_moe": "norm_topk_prob", "qwen3_moe": "norm_topk_prob",
                       "olmoe": "norm_topk_prob"}
NOT_RECORDED = -1
ROUTING_DTYPE = torch.int32  # as vLLM's transit buffers; 4 bytes per token, layer and pick
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ------------------------------------------------------------------------------------------------------ the math
def replayed_gate_weights(router_logits: torch.Tensor, experts: torch.Tensor, renormalise: bool) -> torch.Tensor:
    """The gate weights of `experts` [tokens, k] under the router's own probabilities  # [tokens, k] fp32:

        p = softmax(logits),   w_j = p_{e_j} / sum_i p_{e_i}   (renormalise),   else   w_j = p_{e_j}

    `router_logits` [tokens, experts]. Differentiable in the logits (the router learns through w)."""
    probs = torch.softmax(router_logits.float(), dim=-1)                             # [tokens, E]
    weights = probs.gather(-1, experts.long())                                       # [tokens, k]
    return weights / weights.sum(dim=-1, keepdim=True) if renormalise else weights


def same_expert_sets(own: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """Per token, whether the trainer's own top-k [tokens, k] is the engine's set [tokens, k] (order aside)  # [tokens]
    bool."""
    return (own.sort(dim=-1).values == replayed.to(own.dtype).sort(dim=-1).values).all(dim=-1)


def replayed_choice(own: torch.Tensor, replayed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts each token goes to [tokens, k], which tokens have a record [tokens] bool): the engine's where it
    recorded the token, the trainer's own elsewhere."""
    recorded = (replayed >= 0).all(dim=-1)                                           # [tokens]
    return torch.where(recorded.unsqueeze(-1), replayed.to(own.dtype), own), recorded


# ------------------------------------------------------------------------------------------------ the model's routers
@dataclass
class Router:
    layer: int              # the decoder layer it belongs to: its index into a routing array's layers
    module: torch.nn.Module
    renormalise: bool


def replay_family(config) -> Optional[str]:
    """The model's family when its routers can be replayed (REPLAYABLE_FAMILIES), else None."""
    config = getattr(config, "text_config", None) or config
    model_type = getattr(config, "model_type", None)
    return model_type if model_type in REPLAYABLE_FAMILIES else None


def is_mixture_of_experts(config) -> bool:
    """Whether the model routes tokens to experts (any family: its config names experts per token)."""
    config = getattr(config, "text_config", None) or config
    return any(getattr(config, key, None) for key in ("num_experts_per_tok", "num_local_experts", "num_experts",
                                                      "n_routed_experts"))


def routing_shape(config) -> tuple[int, int]:
    """(layers, k) of the model's routing arrays: every decoder layer (a dense one holds no record), k experts each."""
    config = getattr(config, "text_config", None) or config
    return config.num_hidden_layers, config.num_experts_per_tok


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The model's MoE routers (transformers' <Family>TopKRouter modules), each with its decoder layer."""
    base = getattr(model, "module", model)  # a DeepSpeed engine
    family = replay_family(getattr(base, "config", None))
    routers = []
    for name, module in base.named_modules():
        if not type(module).__name__.endswith("TopKRouter"):
            continue
        found = _LAYER_INDEX.search(name)
        if found is None:
            continue
        rule = REPLAYABLE_FAMILIES.get(family, True)
        renormalise = rule if isinstance(rule, bool) else bool(getattr(module, rule, False))
        routers.append(Router(int(found.group(1)), module, renormalise))
    return routers


# ---------------------------------------------------------------------------------------------------- replay
class RouterAgreement:
    """Token-layer picks where the trainer's own top-k set equals the engine's, over the forwards it was given to.
    Counted on the device, read once (`share`): no host sync per layer."""

    def __init__(self):
        self._counts: list[torch.Tensor] = []  # per router call: [same, recorded]

    def add(self, same: torch.Tensor, recorded: torch.Tensor) -> None:
        """`same`, `recorded`: [tokens] bool, the agreeing picks among the recorded tokens, and the recorded ones."""
        self._counts.append(torch.stack([(same & recorded).sum(), recorded.sum()]))

    def totals(self) -> tuple[int, int]:
        """(agreeing picks, recorded picks)."""
        if not self._counts:
            return 0, 0
        same, picks = torch.stack([c.cpu() for c in self._counts]).sum(0).tolist()
        return same, picks

    @property
    def share(self) -> Optional[float]:
        same, picks = self.totals()
        return same / picks if picks else None


@dataclass
class _Replay:
    routed: torch.Tensor                       # [rows, S, layers, k]
    attention_mask: torch.Tensor               # [rows, S]
    agreement: Optional[RouterAgreement]
    _real: Optional[torch.Tensor] = None       # the real tokens' routing [M, layers, k], found at the first need

    def for_layer(self, layer: int, tokens: int) -> torch.Tensor:
        """The routing of `layer` in the forward's token order  # [tokens, k]: rows one after the other (padded), or
        their real tokens alone (packed, padding-free); the two are the same order when nothing is padded."""
        rows, columns = self.routed.shape[:2]
        if tokens == rows * columns:
            return self.routed[:, :, layer].reshape(tokens, -1)
        if self._real is None:
            self._real = self.routed[self.attention_mask.bool()]
        if tokens == self._real.shape[0]:
            return self._real[:, layer]
        raise RuntimeError(f"routing replay: a router saw {tokens} tokens; the replayed routing holds {rows} rows x "
                           f"{columns} columns ({self._real.shape[0]} real tokens)")


class RoutingReplay:
    """Forward hooks on a model's routers that replace their top-k choice by the replayed one inside `replaying`
    (and nowhere else: generation routes on its own). Installed once per model (`routing_replay_of`).

    A checkpointed layer runs its forward again in the backward, after `replaying` has ended: the routing of the
    last forward with gradient is kept for it and used only while autograd runs a backward."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self._active: list[_Replay] = []
        self._for_backward: Optional[_Replay] = None
        for router in self.routers:
            router.module.register_forward_hook(self._hook(router))

    @contextmanager
    def replaying(self, routed: torch.Tensor, attention_mask: torch.Tensor,
                  agreement: Optional[RouterAgreement] = None):
        """Forwards inside route each token as `routed` [rows, S, layers, k] says (the rows' attention_mask [rows, S]:
        which tokens a padding-free forward keeps); `agreement` counts the picks the trainer would have made alike."""
        replay = _Replay(routed, attention_mask, agreement)
        self._active.append(replay)
        try:
            yield replay
        finally:
            self._active.remove(replay)
            if torch.is_grad_enabled():
                self._for_backward = replay

    def _current(self) -> Optional[_Replay]:
        if self._active:
            return self._active[-1]
        if torch._C._current_graph_task_id() != -1:  # in a backward: a checkpointed layer's forward, run again
            return self._for_backward
        if torch.is_grad_enabled():  # a forward with gradient and no replay: its backward routes on its own too
            self._for_backward = None
        return None

    def _hook(self, router: Router):
        def replace_choice(module, inputs, output):
            replay = self._current()
            if replay is None:
                return output
            logits, scores, own = output                                           # [T, E], [T, k], [T, k]
            replayed = replay.for_layer(router.layer, own.shape[0]).to(own.device)
            experts, recorded = replayed_choice(own, replayed)
            if replay.agreement is not None and self._active:  # not again in a backward's recompute
                replay.agreement.add(same_expert_sets(own, replayed), recorded)
            weights = replayed_gate_weights(logits, experts, router.renormalise).to(scores.dtype)
            return logits, weights, experts
        return replace_choice


def routing_replay_of(model: torch.nn.Module) -> RoutingReplay:
    """The model's RoutingReplay, installed at the first call (through DeepSpeed and peft wrappers alike)."""
    base = getattr(model, "module", model)
    replay = getattr(base, "_grpo_routing_replay", None)
    if replay is None:
        replay = RoutingReplay(base)
        if not replay.routers:
            raise ValueError(f"routing replay: {type(base).__name__} has no MoE router that can be replayed "
                             f"(families: {', '.join(REPLAYABLE_FAMILIES)})")
        base._grpo_routing_replay = replay
    return replay


@contextmanager
def replayed_routing(model: torch.nn.Module, routed: Optional[torch.Tensor], attention_mask: torch.Tensor,
                     agreement: Optional[RouterAgreement] = None):
    """`RoutingReplay.replaying` on the model's routers; nothing when `routed` is None (no routing recorded)."""
    if routed is None:
        yield None
        return
    with routing_replay_of(model).replaying(routed, attention_mask, agreement) as replay:
        yield replay
