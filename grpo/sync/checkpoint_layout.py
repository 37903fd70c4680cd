"""The checkpoint's own tensors from a model's live ones, where transformers changed more than names on load.

transformers 5 converts some checkpoints as it loads them (its conversion mapping): a mixture-of-experts model's
per-expert linears become one fused tensor per layer, and some modules move,

    Mixtral   block_sparse_moe.experts.{e}.w1 / w3 [I, H]   ->  mlp.experts.gate_up_proj [E, 2I, H]  (w1 rows first)
              block_sparse_moe.experts.{e}.w2 [H, I]        ->  mlp.experts.down_proj   [E, H, I]
              block_sparse_moe.gate                         ->  mlp.gate
    Qwen3-MoE mlp.experts.{e}.gate_proj / up_proj / down_proj  ->  mlp.experts.gate_up_proj / down_proj

while a rollout engine (vLLM) loaded the checkpoint as saved and knows its names only (Mixtral's under
transformers' names fails in vLLM's loader: "no module or parameter named 'layers.0.mlp'"). transformers' own
reversal (the one save_pretrained runs) gives those tensors back, split out of the live ones, so a sync sends what
the checkpoint holds, under its names. The prefix renames of vision-language models (grpo.model.vision) stay where
they are: they are 1:1 and used beside the sync; what they already cover is not converted again here.
"""
from __future__ import annotations

import logging
import weakref
from typing import Callable, Iterable, Iterator

import torch

from grpo.model.vision import checkpoint_prefixes, rename

logger = logging.getLogger("grpo")
# model -> the names converted_names found for it, once (a sync asks at every step)
_CONVERTED: "weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]]" = weakref.WeakKeyDictionary()


def _revert(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' reversal of the conversions the model was loaded with, its quantizer's left out (_layout_only)."""
    from transformers.core_model_loading import revert_weight_conversion

    recorded = getattr(model, "_weight_conversions", None)  # (None: not loaded by from_pretrained)
    if recorded is None:
        return revert_weight_conversion(model, tensors)
    layout = _layout_only(model, recorded)
    if not layout:  # nothing but the quantizer's: the live names are the checkpoint's
        return dict(tensors)
    if len(layout) == len(recorded):
        return revert_weight_conversion(model, tensors)
    model._weight_conversions = layout
    try:
        return revert_weight_conversion(model, tensors)
    finally:
        model._weight_conversions = recorded


def _layout_only(model: torch.nn.Module, conversions: list) -> list:
    """`conversions` less those made of the quantizer's operations only. Loading a checkpoint saved in 4 bits,
    transformers' bitsandbytes quantizer adds a converter that gathers each weight's quantization state (weight.absmax,
    weight.quant_map, ...) into the live 4-bit weight under the weight's own name; it has no reverse operation
    (reverting it raised NotImplementedError, for any model saved in 4 bits), and it needs none: the sync sends that
    weight dequantized, under the name a 16-bit checkpoint gives it. A converter that also changes the layout (a
    mixture of experts' per-expert weights dequantized, then fused) is kept."""
    quantizer = getattr(model, "hf_quantizer", None)
    load_operations = getattr(quantizer, "get_load_operations", None)
    quantizer_ops = tuple(load_operations().values()) if callable(load_operations) else ()

    def the_quantizers(op) -> bool:
        return getattr(op, "hf_quantizer", None) is not None or isinstance(op, quantizer_ops)

    return [conversion for conversion in conversions
            if not (getattr(conversion, "operations", None) and all(map(the_quantizers, conversion.operations)))]


def converted_names(model: torch.nn.Module, live_shapes: Callable[[], dict[str, torch.Size]]) -> frozenset[str]:
    """The live parameter names (`live_shapes()`: name -> shape) whose checkpoint tensors differ by more than the
    1:1 prefix renames (grpo.model.vision), found by reverting the conversion on shape-only (meta) tensors the first
    time a model is asked about, then kept."""
    if model in _CONVERTED:
        return _CONVERTED[model]
    shapes, prefixes = live_shapes(), checkpoint_prefixes(model)
    try:
        reverted = _revert(model, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    except Exception as err:  # noqa: BLE001  (transformers' internals: the sync then sends live names, as before)
        logger.warning("could not map this model's weights back to its checkpoint's names (%s: %s); the rollout "
                       "engine gets the names transformers uses in memory", type(err).__name__, err)
        reverted = None
    names = frozenset(name for name in shapes if reverted is not None and rename(name, prefixes) not in reverted)
    if names:
        logger.info("weight sync converts the tensors transformers fused or moved on load back to the "
                    "checkpoint's layout, as the rollout engine loaded them")
    _CONVERTED[model] = names
    return names


def to_checkpoint(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                  converted: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass (live name, tensor) pairs through, those in `converted` reverted to the checkpoint's (name, tensor)
    pairs. The stream comes one module at a time; a module's converted tensors are reverted together (a reversal
    may need several of them) when the next module starts."""
    if not converted:  # (most models: nothing to convert)
        yield from named
        return
    group: dict[str, torch.Tensor] = {}
    owner = None
    for name, tensor in named:
        if name not in converted:
            yield name, tensor
            continue
        module = name.rpartition(".")[0]
        if group and module != owner:
            yield from _revert(model, group).items()
            group = {}
        owner = module
        group[name] = tensor
    if group:
        yield from _revert(model, group).items()


class _Scattered:
    """Where a checkpoint tensor lives inside a live (fused) one: flat element indices, so that copy_ writes it there
    (transformers' reversal of a fused tensor may copy rather than view)."""

    def __init__(self, live: torch.Tensor, index: torch.Tensor):
        self.live, self.index, self.shape = live, index.reshape(-1), index.shape

    def copy_(self, tensor: torch.Tensor) -> None:
        flat = self.live.view(-1)  # (int32 indices, held at half the size: index_copy_ takes int64)
        flat.index_copy_(0, self.index.to(flat.device, torch.int64), tensor.reshape(-1).to(flat.dtype))


def checkpoint_views(model: torch.nn.Module) -> dict:
    """checkpoint name -> where the model holds it, something to `copy_` a sent tensor into (tied weights under each
    of their names): the live tensor itself, or its place inside a fused one. For a model of the same class that
    receives a sync sent in checkpoint names."""
    own, prefixes = model.state_dict(keep_vars=True), checkpoint_prefixes(model)
    converted = converted_names(model, lambda: {name: p.shape for name, p in model.named_parameters()})
    views = {rename(name, prefixes): tensor for name, tensor in own.items() if name not in converted}
    for name in converted:  # revert each live tensor's element numbers: the checkpoint tensors' places in it
        live = own[name].data
        numbers = torch.arange(live.numel(), dtype=torch.int32 if live.numel() < 2**31 else torch.int64)
        for saved, index in _revert(model, {name: numbers.view(live.shape)}).items():
            views[saved] = _Scattered(live, index)
    return views
