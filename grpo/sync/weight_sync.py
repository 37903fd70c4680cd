"""Weight sync: the policy being trained, as HF-checkpoint (name, tensor) pairs for a rollout engine.

Streamed one module at a time, so memory stays bounded by the largest layer, never the whole model:
  full   the parameters as trained (ZeRO-3: gathered one module at a time)
  lora   only what the adapter changes, merged on the fly in fp32 (the training model is never merged/unmerged):
           weight  W + (alpha / r) * B @ A          (transposed for fan_in_fan_out layers such as GPT-2's Conv1D)
           bias    b + (alpha / r) * b_B            (only with peft's lora_bias=True)
         plus the trained copies of modules_to_save
  qlora  dequantize_4bit(W) + (alpha / r) * B @ A (a mixture of experts' 4-bit experts too, expert by expert:
         grpo.model.quantized_experts), and on the first sync every other 4-bit linear and expert stack dequantized too:
         the engine loads the unquantized checkpoint, and must sample from exactly the quantized policy being trained
An engine that drops its weights while it sleeps (`needs_every_weight`, vLLM's level-2 sleep) gets the whole policy
after every step instead: lora / qlora then also send their frozen tensors (embeddings, norms, layers without an
adapter, 4-bit ones dequantized), which costs a copy on the GPU instead of two trips through CPU memory.
An in-process engine on one GPU (`weight_views`) is written in place: each tensor goes straight into the engine's
own block of rows (grpo.sync.engine_layout), a LoRA layer as W (4-bit: dequantized) + (alpha / r) * B @ A in one
pass of grpo.sync.merge_kernel (without Triton: W copied there, then one GEMM added); what has no such block (a
padded vocabulary) goes through load_weights.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from grpo.config.strategy import Strategy
from grpo.errors import ConfigError
from grpo.model.layer_weights import (PEFT_PREFIX, active_adapters, checkpoint_name, dense_weight, is_4bit,
                                     lora_adapters, plain_lora, write_weight)
from grpo.model.quantized_experts import dense_values, four_bit_experts
from grpo.model.vision import checkpoint_prefixes, rename
from grpo.sync.checkpoint_layout import converted_names, to_checkpoint
from grpo.sync.expert_adapters import (adapted_parameters, expert_lora_parameters, expert_wrappers,
                                      merged_expert_weights, vllm_expert_adapter)
from grpo.sync.in_place_merge import in_place_layers

logger = logging.getLogger("grpo")
_KERNEL_FAILED: list[Exception] = []  # the merge kernel's failure, once: later syncs take the unfused path


@dataclass
class SyncStats:
    """What one sync moved: wall time, bytes handed to the engine, number of tensors."""
    seconds: float
    bytes: int
    tensors: int


def iter_policy_weights(model, strategy: Strategy, *, dtype: torch.dtype = torch.bfloat16, zero3: bool = False,
                        first_sync: bool = True, everything: bool = False,
                        into: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor in `dtype`) for what the rollout engine must load after an optimizer step.

    `model` is the module being trained (DeepSpeed's `engine.module`): a plain HF model for full fine-tuning, a peft
    model for a strategy with an adapter (`strategy` may be given by its name). With `zero3=True` its parameters are
    partitioned and each module's are gathered in turn.
    `everything`: every tensor of the policy, not only what changed (for an engine that dropped its weights).
    `into`: checkpoint name -> a tensor of the engine's (grpo.sync.engine_layout.writable_blocks); those are
    written there in place and yielded as that very tensor, so nothing else holds them.
    """
    prefixes = checkpoint_prefixes(model)  # peft forwards .config to the base model
    converted = converted_on_load(model)

    def target(name: str) -> torch.Tensor | None:
        return into.get(rename(name, prefixes)) if into and name not in converted else None

    strategy = Strategy.of(strategy)
    if strategy.has_adapter:
        named = _iter_adapter(model, dtype, zero3,
                              dequantize_frozen=everything or (first_sync and strategy.four_bit_base),
                              everything=everything, target=target)
    else:
        named = _iter_full(model, dtype, zero3, target)
    # the checkpoint's layout: vision-language models' prefixes (grpo/model/vision.py), fused experts split again
    for name, tensor in to_checkpoint(_base_model(model), named, converted):
        yield rename(name, prefixes), tensor


def converted_on_load(model) -> frozenset[str]:
    """Names (as transformers holds them) of the tensors transformers converted on load beyond the prefix renames
    (e.g. a mixture-of-experts model's fused experts): what the sync converts back (grpo.sync.checkpoint_layout)."""
    return converted_names(_base_model(model), lambda: _live_shapes(model))


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def checkpoint_shapes(model) -> dict[str, torch.Size]:
    """checkpoint name -> shape of each tensor of the policy's base (4-bit weights unpacked, ZeRO-3 partitions whole):
    what an engine needs to find its blocks of them (grpo.sync.engine_layout)."""
    prefixes = checkpoint_prefixes(model)
    return {rename(name, prefixes): shape for name, shape in _live_shapes(model).items()}


def _live_shapes(model) -> dict[str, torch.Size]:
    """The base's parameter names as transformers holds them (peft's prefix and .base_layer taken out) -> shape."""
    shapes = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        shape = param.quant_state.shape if is_4bit(param) else getattr(param, "ds_shape", param.shape)
        shapes[checkpoint_name(name)] = torch.Size(shape)
    return shapes


def iter_adapter_tensors(model, *, dtype: torch.dtype = torch.bfloat16,
                         zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the trained LoRA adapter as an engine that holds the base takes it: (peft name, tensor in `dtype`),

        base_model.model.<module>.lora_A.weight    A            [r, in]
        base_model.model.<module>.lora_B.weight    scale * B    [out, r]     scale = the layer's alpha / r

    so the engine computes W x + B' A x with the layer's own scale (rank and alpha patterns, rsLoRA included).
    <module> is the checkpoint's name (a vision-language model's model.layers.*, as the merged sync sends), which
    vLLM's model renames as it renames its checkpoint (Qwen2.5-VL: language_model.model.layers.*). LoRA on a mixture
    of experts' fused expert tensors goes as one such pair per expert and checkpoint tensor
    (grpo.sync.expert_adapters: ...experts.<e>.w1 / w2 / w3 for Mixtral)."""
    from peft.tuners.lora import LoraLayer

    prefixes = checkpoint_prefixes(model)
    experts_done: set[int] = set()  # nested ParamWrappers of one experts module, sent with the outermost
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or id(module) in experts_done:
            continue
        wrappers = expert_wrappers(module)
        if wrappers:  # LoRA on fused experts: one plain LoRA per expert and checkpoint tensor (expert_adapters)
            experts_done.update(id(w) for w in wrappers)
            with _gathered(expert_lora_parameters(module), zero3):
                yield from vllm_expert_adapter(_base_model(model), checkpoint_name(module_name), module,
                                               dtype).items()
            continue
        adapters = lora_adapters(module)
        if len(adapters) > 1:
            raise ConfigError(f"{checkpoint_name(module_name)} has {len(adapters)} active adapters; the rollout "
                              "engine takes one: use --rollout_weights merged")
        for a in adapters:
            if getattr(module, "lora_bias", {}).get(a, False) or getattr(module, "fan_in_fan_out", False):
                raise ConfigError("the rollout engine takes plain LoRA adapters (no lora_bias, no fan_in_fan_out "
                                  "layers): use --rollout_weights merged")
            lora_a, lora_b = module.lora_A[a].weight, module.lora_B[a].weight
            name = PEFT_PREFIX + rename(checkpoint_name(module_name), prefixes)
            with _gathered([lora_a, lora_b], zero3), torch.no_grad():
                yield f"{name}.lora_A.weight", lora_a.detach().to(dtype, copy=True)
                yield f"{name}.lora_B.weight", (lora_b.detach().float() * module.scaling[a]).to(dtype)


def sync_weights(engine, model, strategy: Strategy, *, zero3: bool = False, first_sync: bool = False,
                 dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = 256 * 2**20) -> SyncStats:
    """Stream the policy's weights into `engine.load_weights`, at most ~chunk_bytes per call (plus one tensor).
    All of them when the engine says it `needs_every_weight`, else what changed since the last sync. An engine that
    `takes_adapter` gets the LoRA adapter alone, in one call; one that `merges_in_place` the LoRA layers' B and A."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the update's queued kernels are its own time, not the sync's
    start = time.perf_counter()
    if engine.merges_in_place:  # the adapter, merged by the engine into the base it shares
        layers = in_place_layers(model)
        engine.load_merge(layers)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return SyncStats(seconds=time.perf_counter() - start, tensors=2 * len(layers),
                         bytes=sum(t.numel() * t.element_size() for _, b, a, _ in layers for t in (b, a)))
    if engine.takes_adapter:
        tensors = dict(iter_adapter_tensors(model, dtype=dtype, zero3=zero3))
        engine.load_adapter(tensors)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return SyncStats(seconds=time.perf_counter() - start,
                         bytes=sum(t.numel() * t.element_size() for t in tensors.values()), tensors=len(tensors))
    total, count, chunk, chunk_size = 0, 0, [], 0
    everything = engine.needs_every_weight
    into = engine.weight_views(model)  # written in place: no copy, no loader per tensor
    for name, tensor in iter_policy_weights(model, strategy, dtype=dtype, zero3=zero3, first_sync=first_sync,
                                            everything=everything, into=into):
        size = tensor.numel() * tensor.element_size()
        total += size
        count += 1
        if into.get(name) is tensor:
            continue
        if chunk and chunk_size + size > chunk_bytes:
            engine.load_weights(chunk, complete=not everything)  # it may wake only once the last chunk is in
            chunk, chunk_size = [], 0
        chunk.append((name, tensor))
        chunk_size += size
    if chunk or into:
        engine.load_weights(chunk)  # (also when empty: the engine learns that the load is whole)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the engine copies asynchronously; the time must include the copies
    return SyncStats(seconds=time.perf_counter() - start, bytes=total, tensors=count)


# ------------------------------------------------------------------------------------------------------ helpers
def _gathered(params: list, zero3: bool):
    """ZeRO-3: the full tensors of `params` for the duration of the block (read-only); otherwise nothing."""
    if not zero3 or not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _owned(tensor: torch.Tensor, dtype: torch.dtype, zero3: bool) -> torch.Tensor:
    """`tensor` in `dtype`; copied under ZeRO-3, where the gathered storage is freed when the block ends."""
    out = tensor.detach().to(dtype)
    return out.clone() if zero3 and out.data_ptr() == tensor.data_ptr() else out


def _module_tensors(prefix: str, named_params, dtype: torch.dtype, zero3: bool, seen: set[int], target):
    """Yield (prefix.name, tensor in `dtype`) for the parameters not yet in `seen`, gathered together under ZeRO-3;
    those with a `target` tensor are copied into it and yielded as it. `seen` holds the ids already sent: tied
    weights (embed_tokens / lm_head) are one parameter, sent once."""
    params = [(n, p) for n, p in named_params if id(p) not in seen]
    seen.update(id(p) for _, p in params)
    with _gathered([p for _, p in params], zero3):
        for pname, param in params:  # (.data: no autograd, into the engine's tensor either)
            name = f"{prefix}.{pname}" if prefix else pname
            out = target(name)
            yield name, out.copy_(param.data) if out is not None else _owned(param.data, dtype, zero3)


# ----------------------------------------------------------------------------------------------------- strategies
def _iter_full(model, dtype, zero3, target):
    seen = set()  # tied weights (embed_tokens / lm_head) are one parameter: sent once, under its first name
    for module_name, module in model.named_modules():
        yield from _module_tensors(checkpoint_name(module_name), module.named_parameters(recurse=False), dtype,
                                   zero3, seen, target)


def _lora_merged(module, adapters: list[str], zero3: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 weight (and bias when lora_bias) of a LoRA layer with its adapters folded in, as peft's merge does."""
    base = module.get_base_layer()
    parts = [base.weight] + ([base.bias] if getattr(base, "bias", None) is not None else [])
    for a in adapters:
        parts += [module.lora_A[a].weight, *module.lora_B[a].parameters()]
    with _gathered(parts, zero3), torch.no_grad():  # a copy for the engine: no autograd graph
        weight = dense_weight(base)                                          # [out, in] ([in, out] if fan_in_fan_out)
        bias = base.bias.data.to(torch.float32, copy=True) if getattr(base, "bias", None) is not None else None
        for a in adapters:
            scale = module.scaling[a]                                         # alpha / r (rank/alpha patterns incl.)
            delta = (module.lora_B[a].weight.float() @ module.lora_A[a].weight.float()) * scale   # [out, r] @ [r, in]
            weight += delta.T if getattr(module, "fan_in_fan_out", False) else delta
            if getattr(module, "lora_bias", {}).get(a, False):
                if bias is None:
                    raise ConfigError("lora_bias=True needs a base layer with a bias; train without lora_bias")
                bias += module.lora_B[a].bias.float() * scale
    return weight, bias  # new tensors: they outlive a ZeRO-3 gather


def _lora_merged_into(out: torch.Tensor, module, adapters: list[str], zero3: bool) -> torch.Tensor:
    """out <- W + sum over the adapters of (alpha / r) * B @ A, written into `out` (an engine's tensor) with no dense
    copy of its own: W copied (4-bit: dequantized) into it, then each product added by one GEMM over B and A in out's
    dtype, which accumulates in fp32 and rounds once; on the GPU one adapter goes in one pass that reads W and writes
    out once (grpo.sync.merge_kernel: 25 -> 10 ms for Qwen2.5-7B's 196 linears in 4 bits on an H100). Plain LoRA
    only (no lora_bias, no fan_in_fan_out)."""
    base = module.get_base_layer()
    parts = [base.weight] + [p for a in adapters for p in (module.lora_A[a].weight, module.lora_B[a].weight)]
    with _gathered(parts, zero3), torch.no_grad():
        if len(adapters) == 1 and _merged_in_one_pass(out, module, adapters[0]):
            return out
        write_weight(out, base.weight)
        for a in adapters:
            lora_b, lora_a = module.lora_B[a].weight.to(out.dtype), module.lora_A[a].weight.to(out.dtype)
            out.addmm_(lora_b, lora_a, alpha=module.scaling[a])              # [out, r] @ [r, in]
    return out


def _merged_in_one_pass(out: torch.Tensor, module, adapter: str) -> bool:
    """out <- W + s * B @ A by grpo.sync.merge_kernel, for an engine tensor on the GPU where Triton is installed, the
    kernel takes the layer and has not failed in this process; False where it did not write."""
    if not out.is_cuda or _KERNEL_FAILED:
        return False
    try:
        from grpo.sync import merge_kernel
    except ImportError:  # no Triton: dequantize (or copy), then one GEMM
        return False
    weight = module.get_base_layer().weight
    lora_b, lora_a = module.lora_B[adapter].weight.data, module.lora_A[adapter].weight.data
    if not merge_kernel.fits(out, weight, lora_b, lora_a):
        return False
    try:
        merge_kernel.merge_into(out, weight, lora_b, lora_a, module.scaling[adapter])
        return True
    except Exception as exc:  # e.g. a GPU Triton cannot compile it for: the unfused path from now on
        _KERNEL_FAILED.append(exc)
        logger.warning(f"the one-pass merge kernel failed ({type(exc).__name__}: {exc}); weight syncs dequantize "
                       "(or copy) and add one GEMM instead")
        return False


def _iter_adapter(model, dtype, zero3, dequantize_frozen: bool, everything: bool = False, target=lambda name: None):
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    # submodules of a wrapper are handled with the wrapper; named_modules lists a module's submodules right after it
    # (depth first), so only the latest wrapper's prefix can match
    wrapper_prefix: str | None = None
    seen: set[int] = set()  # with `everything`: tied weights (embed_tokens / lm_head) sent once
    for module_name, module in model.named_modules():
        if wrapper_prefix is not None and module_name.startswith(wrapper_prefix):
            continue
        wrapper_prefix = None
        name = checkpoint_name(module_name)
        if isinstance(module, ModulesToSaveWrapper):
            wrapper_prefix = module_name + "."
            active = [a for a in active_adapters(module) if a in module.modules_to_save]
            if not active and not everything:
                continue
            # what the wrapper's forward runs: the active adapter's trained copy, else the original module
            trained = module.modules_to_save[active[0]] if active else module.original_module
            yield from _module_tensors(name, trained.named_parameters(), dtype, zero3, seen, target)
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise ConfigError(f"weight sync cannot send {type(module).__name__} ({name}); "
                              "train without trainable_token_indices")
        elif isinstance(module, LoraLayer) and expert_wrappers(module):  # fused experts: W_e + s * B_e @ A_e
            wrapper_prefix = module_name + "."
            experts = expert_wrappers(module)
            if not (everything or adapted_parameters(experts)
                    or (dequantize_frozen and four_bit_experts(experts[-1].get_base_layer()))):
                continue
            with _gathered(expert_lora_parameters(module), zero3):
                merged = merged_expert_weights(module, everything, dequantize_frozen)
            for pname, weight in merged:  # (live names: to_checkpoint splits them into the checkpoint's experts)
                yield f"{name}.{pname}", weight.to(dtype)
        elif isinstance(module, LoraLayer):
            wrapper_prefix = module_name + "."
            adapters = lora_adapters(module)
            if not (adapters or everything or (dequantize_frozen and is_4bit(module.get_base_layer().weight))):
                continue  # unchanged since the checkpoint the engine loaded
            base = module.get_base_layer()
            if everything:
                seen.update(id(p) for p in base.parameters())
            out = target(f"{name}.weight") if plain_lora(module, adapters) else None
            if out is not None:  # the bias, if any, is the base's own
                yield f"{name}.weight", _lora_merged_into(out, module, adapters, zero3)
                if everything and getattr(base, "bias", None) is not None:
                    yield from _module_tensors(name, [("bias", base.bias)], dtype, zero3, set(), target)
                continue
            weight, bias = _lora_merged(module, adapters, zero3)
            yield f"{name}.weight", weight.to(dtype)
            if bias is not None and (everything or any(getattr(module, "lora_bias", {}).get(a, False)
                                                       for a in adapters)):
                yield f"{name}.bias", bias.to(dtype)
        elif dequantize_frozen and is_4bit(getattr(module, "weight", None)):
            seen.update(id(p) for p in module.parameters(recurse=False))
            out = target(f"{name}.weight")
            yield f"{name}.weight", write_weight(out, module.weight) if out is not None \
                else dense_weight(module).to(dtype)
            if everything and getattr(module, "bias", None) is not None:
                yield from _module_tensors(name, [("bias", module.bias)], dtype, zero3, set(), target)
        elif dequantize_frozen and four_bit_experts(module):  # qlora's unadapted 4-bit experts, dequantized
            params = module.named_parameters(recurse=False) if everything else four_bit_experts(module)
            for pname, param in params:
                if id(param) not in seen:
                    seen.add(id(param))
                    yield f"{name}.{pname}", dense_values(param).to(dtype)
        elif everything:  # a frozen module's own tensors (embeddings, norms, heads), as the checkpoint has them
            yield from _module_tensors(name, module.named_parameters(recurse=False), dtype, zero3, seen, target)
