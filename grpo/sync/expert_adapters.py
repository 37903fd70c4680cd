"""LoRA on a mixture of experts' fused expert tensors, as the trainer holds it and as vLLM takes it.

transformers 5 holds a Mixtral / Qwen3-MoE layer's experts as fused 3-D parameters, [E, out, in] per projection
(`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]). peft adapts such a parameter
with a ParamWrapper whose two factors hold every expert at once:

    lora_A.weight   [E*r, in]     rows e*r .. e*r+r-1 are expert e's A_e                  (expert-major)
    lora_B.weight   [out, E*r]    column j*E + e is column j of expert e's B_e            (rank-major)
    expert e's linear map:   M_e = W_e + s * B_e @ A_e,   A_e [r, in],  B_e [out, r],  s = alpha / r

(peft's ParamWrapper.get_delta_weight; a layout storing W_e transposed, [E, in, out], holds M_e transposed.)

vLLM 0.26 loads expert LoRA of a model whose experts it keeps per checkpoint tensor (Mixtral, Qwen3-MoE: not
`is_3d_moe_weight`) under the checkpoint's per-expert names, one plain LoRA per expert and projection,

    <layer>.block_sparse_moe.experts.<e>.w1 / w2 / w3 .lora_A.weight [r, in], .lora_B.weight [out, r]   (Mixtral)
    <layer>.mlp.experts.<e>.gate_proj / down_proj / up_proj ...                                          (Qwen3-MoE)

and packs them into its fused-MoE LoRA layer (vllm/lora/utils.py process_packed_modules_mapping, with the names of
RoutedExperts.get_expert_mapping; vllm/lora/lora_weights.py PackedLoRALayerWeights.pack_moe, which needs w1, w2
and w3 for every expert). The fused gate_up_proj's rows split into the gate's and the up projection's, which share
A_e: gate = (A_e, B_e[:I]), up = (A_e, B_e[I:]), exactly the fused LoRA's product (the rank stays r).

Which checkpoint tensor holds which rows of which expert is read from transformers' own reversal of its conversion
(the one save_pretrained runs), applied to a tensor of row numbers, so the names are the checkpoint's whatever the
family calls them.
"""
from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

import torch

from grpo.errors import ConfigError
from grpo.model.layer_weights import PEFT_PREFIX, checkpoint_name, lora_adapters
from grpo.model.quantized_experts import dense_values, is_4bit_experts


@dataclass(frozen=True)
class RowBlock:
    """A checkpoint tensor that is rows [start, stop) of expert `expert` in a fused [E, out, in] tensor."""
    name: str       # checkpoint tensor name, e.g. model.layers.0.block_sparse_moe.experts.3.w1.weight
    expert: int
    start: int
    stop: int


# ----------------------------------------------------------------------------------------------- pure layout math
def expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's fused factors -> per-expert ones: A [E, r, in], B [E, out, r] (views where the layout allows).

        lora_a [E*r, in]  -> reshape(E, r, in)
        lora_b [out, E*r] -> reshape(out, r, E).permute(2, 0, 1)
    """
    experts_a = lora_a.reshape(num_experts, -1, lora_a.shape[-1])                     # [E, r, in]
    experts_b = lora_b.reshape(lora_b.shape[0], -1, num_experts).permute(2, 0, 1)     # [E, out, r]
    return experts_a, experts_b


def expert_delta(experts_a: torch.Tensor, experts_b: torch.Tensor, scale: float) -> torch.Tensor:
    """Each expert's LoRA update of its linear map:  D_e = s * B_e @ A_e   -> [E, out, in] (fp32)."""
    return torch.bmm(experts_b.float(), experts_a.float()) * scale


def merged_experts(weight: torch.Tensor, experts_a: torch.Tensor, experts_b: torch.Tensor, scale: float,
                   transposed: bool = False) -> torch.Tensor:
    """W_e + s * B_e @ A_e for every expert, as a new fp32 tensor of weight's layout: [E, out, in], or [E, in, out]
    where the model stores its experts transposed (then D_e is added transposed)."""
    delta = expert_delta(experts_a, experts_b, scale)
    return weight.float() + (delta.transpose(1, 2) if transposed else delta)


def per_expert_lora(blocks: list[RowBlock], experts_a: torch.Tensor, experts_b: torch.Tensor,
                    scale: float) -> dict[str, torch.Tensor]:
    """The per-expert adapter vLLM loads: for each checkpoint tensor (rows start..stop of expert e),

        base_model.model.<module>.lora_A.weight  =  A_e                      [r, in]
        base_model.model.<module>.lora_B.weight  =  s * B_e[start:stop]      [stop - start, r]

    (lora_B scaled, so the engine's own scale is 1). <module> is the checkpoint tensor's name without .weight."""
    tensors = {}
    for block in blocks:
        module = PEFT_PREFIX + block.name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = experts_a[block.expert]
        tensors[f"{module}.lora_B.weight"] = experts_b[block.expert, block.start:block.stop] * scale
    return tensors


def zero_lora(blocks: list[RowBlock], rank: int, in_features: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A zero adapter for the checkpoint tensors of an expert projection that is not adapted: vLLM packs w1, w2
    and w3 of every expert together and needs all three."""
    tensors = {}
    for block in blocks:
        module = PEFT_PREFIX + block.name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"] = torch.zeros(rank, in_features, dtype=dtype)
        tensors[f"{module}.lora_B.weight"] = torch.zeros(block.stop - block.start, rank, dtype=dtype)
    return tensors


def row_blocks_from_numbers(reverted: dict[str, torch.Tensor], rows: int) -> list[RowBlock]:
    """RowBlocks from transformers' reversal of a [E, out, 2] tensor holding e * out + row in both columns: each
    checkpoint tensor must come back as [n, 2], one expert's consecutive rows; anything else (a transposed or
    interleaved layout) is refused. (Two columns, not one: transformers 5.17's SplitModulelist squeezes every size-1
    dim of what it splits, which would drop a width of 1 and make a transposed [1, n] block look like rows.)"""
    blocks = []
    for name, numbers in reverted.items():
        ok = numbers.dim() == 2 and numbers.shape[1] == 2 and torch.equal(numbers[:, 0], numbers[:, 1])
        if ok:
            flat = numbers[:, 0].to(torch.int64)
            expert, start = divmod(int(flat[0]), rows)
            ok = torch.equal(flat, torch.arange(expert * rows + start, expert * rows + start + flat.numel()))
        if not ok:
            raise ConfigError(f"{name}: the checkpoint holds this expert tensor in another layout than a block of "
                              "rows of the fused one (transposed or interleaved); LoRA on these experts cannot be "
                              "sent to vLLM: use --rollout_weights merged")
        blocks.append(RowBlock(name, expert, start, start + flat.numel()))
    return sorted(blocks, key=lambda b: (b.expert, b.start))


# ------------------------------------------------------------------------------------------------- the model's side
def expert_wrappers(module) -> list:
    """The ParamWrappers of a (possibly nested) peft wrapper of one experts module that adapt 3-D parameters,
    outermost first; [] for any other module."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = []
    while isinstance(module, ParamWrapper):
        if getattr(module, "num_experts", 1) > 1 or module.get_param().dim() == 3:
            wrappers.append(module)
        module = module.base_layer
    return wrappers


def is_transposed(wrapper) -> bool:
    """Whether the experts module stores W_e as [in, out] (peft: `is_transposed`, its in/out features not swapped)."""
    return not getattr(wrapper, "_did_swap_in_out_features", True)


def checkpoint_row_blocks(model, live_name: str, shape: torch.Size) -> list[RowBlock]:
    """The checkpoint tensors of the fused live tensor `live_name` ([E, out, in]), as transformers' reversal gives
    them back, with the expert and rows each one is. Every fused tensor of `model` is reverted in one call the first
    time (transformers builds its conversion mapping at each call: 0.08 s, 7 s for Qwen3-30B-A3B's 96 one by one),
    then kept."""
    known = _ROW_BLOCKS.setdefault(model, {})
    if live_name not in known:
        known.update(_row_blocks_of(model, {**_fused_live_shapes(model), live_name: torch.Size(shape)}))
    blocks = known[live_name]
    if isinstance(blocks, ConfigError):
        raise blocks
    return blocks


# model -> live name -> its RowBlocks, or the ConfigError saying why it has none
_ROW_BLOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _fused_live_shapes(model) -> dict[str, torch.Size]:
    """live name (peft's .base_layer taken out) -> shape of the model's 3-D parameters (ZeRO-3: their whole shape)."""
    shapes = {}
    for name, param in model.named_parameters():
        shape = getattr(param, "ds_shape", param.shape)
        if len(shape) == 3 and "lora_" not in name:
            shapes[checkpoint_name(name)] = torch.Size(shape)
    return shapes


def _row_blocks_of(model, shapes: dict[str, torch.Size]) -> dict:
    """RowBlocks (or a ConfigError) of each [E, out, in] tensor in `shapes`, from one reversal of tensors of row
    numbers: tensor i ([E, out, 2]) holds offset_i + e * out + row, so each checkpoint tensor it reverts to says whose
    it is."""
    from transformers.core_model_loading import revert_weight_conversion

    total = sum(shape[0] * shape[1] for shape in shapes.values())
    dtype = torch.int32 if total < 2**31 else torch.int64
    numbers, offsets, start = {}, [], 0
    for name, shape in shapes.items():
        rows = torch.arange(start, start + shape[0] * shape[1], dtype=dtype).view(shape[0], shape[1], 1)
        numbers[name] = rows.expand(-1, -1, 2).contiguous()  # [E, out, 2]: see row_blocks_from_numbers
        offsets.append(start)
        start += shape[0] * shape[1]
    names = list(shapes)
    reverted: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for saved, values in revert_weight_conversion(model, numbers).items():
        index = bisect.bisect_right(offsets, int(values.reshape(-1)[0])) - 1
        reverted[names[index]][saved] = values - offsets[index]
    blocks: dict = {}
    for name, shape in shapes.items():
        if list(reverted[name]) == [name]:  # not converted on load: the checkpoint holds the fused tensor itself
            blocks[name] = ConfigError(f"{name}: the checkpoint holds these experts fused, which vLLM loads as 3-D "
                                       "LoRA (not supported by grpo's adapter sync): use --rollout_weights merged")
            continue
        try:
            blocks[name] = row_blocks_from_numbers(reverted[name], shape[1])
        except ConfigError as err:
            blocks[name] = err
    return blocks


def adapted_parameters(wrappers: list) -> dict[str, list[tuple]]:
    """parameter name -> [(wrapper, adapter)] of the active, unmerged adapters that change it."""
    adapted: dict[str, list[tuple]] = {}
    for wrapper in wrappers:
        for adapter in lora_adapters(wrapper):
            adapted.setdefault(wrapper.parameter_name, []).append((wrapper, adapter))
    return adapted


def vllm_expert_adapter(model, experts_name: str, outer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The per-expert adapter vLLM loads for one experts module (`outer`: peft's outermost ParamWrapper of it,
    `experts_name`: its name as transformers holds it, e.g. model.layers.0.mlp.experts), lora_B scaled; its 3-D
    parameters that no adapter changes get a zero adapter of rank 1 (vLLM needs every projection of every expert).
    `model`: the base model, whose conversion mapping names the checkpoint's tensors."""
    wrappers = expert_wrappers(outer)
    experts = wrappers[-1].get_base_layer()
    adapted = adapted_parameters(wrappers)
    tensors: dict[str, torch.Tensor] = {}
    for pname, param in experts.named_parameters(recurse=False):
        shape = getattr(param, "ds_shape", param.shape)
        if len(shape) != 3:
            continue
        blocks = checkpoint_row_blocks(model, f"{experts_name}.{pname}", torch.Size(shape))
        if pname not in adapted:
            tensors.update(zero_lora(blocks, 1, shape[2], dtype))
            continue
        if len(adapted[pname]) > 1:
            raise ConfigError(f"{experts_name}.{pname} has {len(adapted[pname])} active adapters; the rollout engine "
                              "takes one: use --rollout_weights merged")
        wrapper, adapter = adapted[pname][0]
        if is_transposed(wrapper):
            raise ConfigError(f"{experts_name}.{pname} is stored transposed ([experts, in, out]); grpo sends LoRA "
                              "on [experts, out, in] experts only: use --rollout_weights merged")
        with torch.no_grad():
            experts_a, experts_b = expert_factors(wrapper.lora_A[adapter].weight.detach(),
                                                  wrapper.lora_B[adapter].weight.detach(), wrapper.num_experts)
            lora = per_expert_lora(blocks, experts_a.float(), experts_b.float(), wrapper.scaling[adapter])
        # (own copies: gate and up share A_e, and a view would hold the trained factor's storage)
        tensors.update({name: t.to(dtype, copy=True).contiguous() for name, t in lora.items()})
    return tensors


def merged_expert_weights(outer, everything: bool, dequantize_frozen: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(parameter name, fp32 tensor) of one experts module with its adapters folded in, W_e + s * B_e @ A_e for every
    expert (ZeRO-3: call with the parameters gathered); with `everything`, its other parameters as they are too, with
    `dequantize_frozen` its unadapted 4-bit ones (qlora's experts: grpo.model.quantized_experts), dequantized. A
    4-bit W is read dequantized: the merge is what the trainer computes."""
    wrappers = expert_wrappers(outer)
    experts = wrappers[-1].get_base_layer()
    adapted = adapted_parameters(wrappers)
    out = []
    with torch.no_grad():
        for pname, param in experts.named_parameters(recurse=False):
            if pname not in adapted:
                if everything or (dequantize_frozen and is_4bit_experts(param)):
                    out.append((pname, dense_values(param).float()))
                continue
            weight = dense_values(param).float()
            for wrapper, adapter in adapted[pname]:
                experts_a, experts_b = expert_factors(wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight,
                                                      wrapper.num_experts)
                weight = merged_experts(weight, experts_a, experts_b, wrapper.scaling[adapter], is_transposed(wrapper))
            out.append((pname, weight))
    return out


def expert_lora_parameters(outer) -> list[torch.nn.Parameter]:
    """Every tensor the merge of one experts module reads (for a ZeRO-3 gather)."""
    wrappers = expert_wrappers(outer)
    params = list(wrappers[-1].get_base_layer().parameters(recurse=False))
    for wrapper in wrappers:
        params += [p for a in wrapper.lora_A for p in (wrapper.lora_A[a].weight, wrapper.lora_B[a].weight)]
    return params
