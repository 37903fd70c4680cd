"""qlora's 4-bit experts: a mixture of experts' fused expert weights held in bitsandbytes 4 bits, read dequantized.

transformers 5 holds a Mixtral / Qwen3-MoE / OLMoE layer's experts as fused 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), about 95% of the model, which bitsandbytes (nn.Linear only) leaves in
16 bits. Here each such parameter becomes an `Experts4bit`: a frozen tensor of the same shape and dtype that stores
every expert as bitsandbytes stores a 4-bit linear weight (packed codes + QuantState, qlora's quant type, block
size and block scale, double-quantized scales) and computes its values only when an operation reads it:

    W[e]                  (the experts' loop in transformers' forward)     -> dequantize_4bit(Q_e)   one expert
    anything else on W    (peft's LoRA fold  W + s * B @ A,  .float(),
                           grouped-mm kernels, comparisons, ...)           -> stack_e dequantize_4bit(Q_e), one layer

so peft's ParamWrapper adapts it unchanged (it reads the parameter's shape and dtype, and folds its per-expert rank-r
factors into the dequantized weight in the experts module's forward: the LoRA trains on the 4-bit experts exactly as
on their dequantized 16-bit values), gradient checkpointing recomputes one layer at a time, and every path that reads
the dense tensor (the merged weight sync, the final export) gets the dequantized values. The stack of one layer is
the most ever held in 16 bits, as peft's own LoRA on 16-bit experts holds it. Writing into it is refused: the base is
frozen.

Quantized per expert (one QuantState each, Q_e = quantize_4bit(W_e) in blocks of --qlora_block_size, W_e first
rounded by grpo.model.qlora_rounding.mse_block_rounding under --qlora_block_scale mse), from the 16-bit values
transformers loaded: its fusing of the checkpoint's per-expert tensors only concatenates them.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch.utils._pytree import tree_map

from grpo.errors import ConfigError

logger = logging.getLogger("grpo")
aten = torch.ops.aten


class Experts4bit(torch.Tensor):
    """A frozen [E, out, in] expert stack (or any 3-D stack of matrices) held as E bitsandbytes 4-bit matrices.

    `packed` [E, out * in / 2] uint8: expert e's codes as quantize_4bit packs them; `states`: its E QuantStates
    (their dtype: the values' dtype); `whole`: where the stack was quantized in one piece, its QuantState, of which
    the experts' states are slices (one dequantize_4bit call reads the whole stack). It reports the dense shape, dtype
    and device; reads dequantize (module docstring)."""

    packed: torch.Tensor
    states: list
    whole: object

    @staticmethod
    def __new__(cls, packed: torch.Tensor, states: list, shape, dtype: torch.dtype, whole=None):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=packed.device,
                                                   requires_grad=False)

    def __init__(self, packed: torch.Tensor, states: list, shape, dtype: torch.dtype, whole=None):
        self.packed = packed
        self.states = states
        self.whole = whole

    # ------------------------------------------------------------------------------------------------- reading
    def expert(self, index: int) -> torch.Tensor:
        """Expert `index`'s [out, in] matrix, dequantized (a new tensor)."""
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(self.packed[index], self.states[index]).view(self.shape[1:]).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The whole [E, out, in] stack, dequantized into one new tensor (in one call, or expert by expert)."""
        import bitsandbytes.functional as bnbf

        if self.whole is not None:
            return bnbf.dequantize_4bit(self.packed, self.whole).view(self.shape).to(self.dtype)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for e in range(self.shape[0]):
            if out.is_cuda and self.states[e].dtype == out.dtype:
                bnbf.dequantize_4bit(self.packed[e], self.states[e], out=out[e])
            else:  # (bitsandbytes 0.50 has no out= kernel on CPU)
                out[e].copy_(self.expert(e))
        return out

    def storage_bytes(self) -> int:
        """Bytes it holds: the packed codes and every expert's quantization state (scales, nested scales, code)."""
        states = [self.whole] if self.whole is not None else self.states  # (the experts' are its slices)
        tensors = {id(t): t for state in states for t in _state_tensors(state)}  # (codebooks are shared)
        return self.packed.numel() * self.packed.element_size() + sum(t.numel() * t.element_size()
                                                                      for t in tensors.values())

    def __repr__(self, *, tensor_contents=None) -> str:
        quant = self.states[0].quant_type if self.states else "?"
        return (f"Experts4bit(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, {quant}, "
                f"blocksize={self.states[0].blocksize if self.states else '?'})")

    def _moved(self, device) -> "Experts4bit":
        if self.whole is not None:
            whole = _moved_states([self.whole], device)[0]
            return Experts4bit(self.packed.to(device), _expert_states(whole, self.shape), self.shape, self.dtype,
                               whole)
        return Experts4bit(self.packed.to(device), _moved_states(self.states, device), self.shape, self.dtype)

    # ---------------------------------------------------------------------------------------------- operations
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):  # nn.Parameter, .data, .detach(): the same codes
            self = args[0]
            return Experts4bit(self.packed, self.states, self.shape, self.dtype, self.whole)
        if func is aten.select.int and args[1] == 0:  # W[e]: one expert
            self, index = args[0], args[2]
            return self.expert(index % self.shape[0])
        if func is aten._to_copy.default and _only_moves(args[0], kwargs):  # .to(device): the codes move
            return args[0]._moved(kwargs.get("device") or args[0].device)
        if func is aten.set_.source_Tensor and args[0] is args[1]:  # (torch's parametrize re-sets the original)
            return args[0]
        if func._schema.is_mutable and _writes_into_4bit(func, args, kwargs):
            raise ConfigError(f"{func}: qlora's 4-bit experts are a frozen base (grpo.model.quantized_experts); "
                              "nothing may write into them (merge an adapter into a 16-bit copy instead)")
        args, kwargs = tree_map(_dense, (args, kwargs))
        return func(*args, **kwargs)


def _dense(value):
    return value.dequantize() if isinstance(value, Experts4bit) else value


def _writes_into_4bit(func, args, kwargs) -> bool:
    """Whether the operation writes into an Experts4bit (an argument its schema marks as written)."""
    for i, argument in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, Experts4bit):
            return True
    return False


def _only_moves(self: Experts4bit, kwargs: dict) -> bool:
    """A .to() that changes the device at most (no dtype, layout or memory format change)."""
    return (kwargs.get("dtype") in (None, self.dtype) and kwargs.get("layout") in (None, torch.strided)
            and kwargs.get("memory_format") in (None, torch.preserve_format))


def _moved_states(states: list, device) -> list:
    """The QuantStates on `device` (QuantState.to moves in place; the original's are copied first)."""
    import copy

    moved = []
    for state in states:
        state = copy.deepcopy(state)
        state.to(device)
        moved.append(state)
    return moved


def _state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if getattr(state, "offset", None) is not None and isinstance(state.offset, torch.Tensor):
        tensors.append(state.offset)
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def is_4bit_experts(tensor) -> bool:
    return isinstance(tensor, Experts4bit)


def dense_values(param) -> torch.Tensor:
    """A parameter's values as a plain tensor: 4-bit experts dequantized (a new tensor), any other its .data."""
    return param.dequantize() if isinstance(param, Experts4bit) else param.data


def four_bit_experts(module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the module's own 4-bit expert stacks."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, Experts4bit)]


# --------------------------------------------------------------------------------------------------- quantizing
@torch.no_grad()
def quantize_experts(weight: torch.Tensor, quant_type: str, block_size: int, block_scale: str = "absmax",
                     double_quant: bool = True) -> Experts4bit:
    """The [E, out, in] stack `weight` in 4 bits, expert by expert in its own dtype and on its own device:

        Q_e = quantize_4bit(W_e, blocksize=block_size, quant_type)   (W_e rounded by mse_block_rounding first when
                                                                      block_scale is "mse")"""
    import bitsandbytes.functional as bnbf

    from grpo.model.qlora_rounding import codebook, mse_block_rounding

    experts, rows, cols = weight.shape
    if double_quant and (rows * cols) % (block_size * NESTED_BLOCK) == 0:
        # no block, nor block of scales, straddles two experts: the stack in one piece (one call to read it whole),
        # each expert's state a slice of it (every real model's experts; not the tiniest test ones)
        w = weight.contiguous()
        if block_scale == "mse":
            w = mse_block_rounding(w, codebook(quant_type), block_size).to(weight.dtype)
        codes, whole = bnbf.quantize_4bit(w, blocksize=block_size, quant_type=quant_type, compress_statistics=True)
        return Experts4bit(codes.view(experts, -1), _expert_states(whole, weight.shape), weight.shape, weight.dtype,
                           whole)
    packed = torch.empty(experts, (rows * cols + 1) // 2, dtype=torch.uint8, device=weight.device)
    states = []
    for e in range(experts):
        w = weight[e].contiguous()
        if block_scale == "mse":
            w = mse_block_rounding(w, codebook(quant_type), block_size).to(weight.dtype)
        codes, state = bnbf.quantize_4bit(w, blocksize=block_size, quant_type=quant_type,
                                          compress_statistics=double_quant)
        packed[e].copy_(codes.view(-1))
        if states:  # one codebook (and nested codebook) for all: bitsandbytes gives each state its own copy
            state.code = _same(state.code, states[0].code)
            if state.state2 is not None and states[0].state2 is not None:
                state.state2.code = _same(state.state2.code, states[0].state2.code)
        states.append(state)
    return Experts4bit(packed, states, weight.shape, weight.dtype)


NESTED_BLOCK = 256  # bitsandbytes' double quantization: one fp32 scale per 256 block scales


def _expert_states(whole, shape) -> list:
    """Each expert's QuantState as slices of the whole stack's (blocks and nested blocks aligned with the experts):
    its 8-bit block scales, its nested fp32 scales, the shared codebooks and offset."""
    from bitsandbytes.functional import QuantState

    experts, rows, cols = shape
    blocks = rows * cols // whole.blocksize
    nested = blocks // whole.state2.blocksize
    return [QuantState(absmax=whole.absmax[e * blocks:(e + 1) * blocks], shape=torch.Size((rows, cols)),
                       code=whole.code, blocksize=whole.blocksize, quant_type=whole.quant_type, dtype=whole.dtype,
                       offset=whole.offset,
                       state2=QuantState(absmax=whole.state2.absmax[e * nested:(e + 1) * nested],
                                         code=whole.state2.code, blocksize=whole.state2.blocksize,
                                         dtype=whole.state2.dtype))
            for e in range(experts)]


def _same(tensor: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return shared if tensor is shared or torch.equal(tensor, shared) else tensor


def fused_expert_slots(model) -> list[tuple[torch.nn.Module, str]]:
    """(module, parameter name) of the model's fused expert weights: its 3-D parameters outside convolutions (as
    grpo.model.expert_targets.fused_expert_parameters finds them), 4-bit ones included."""
    slots = []
    for module in model.modules():
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                slots.append((module, pname))
    return slots


@torch.no_grad()
def quantize_fused_experts(model, quant_type: str, block_size: int, block_scale: str) -> int:
    """Replace every fused expert parameter of a loaded model by its frozen Experts4bit (one parameter at a time: the
    16-bit tensor is freed before the next is quantized; those experts_quantized_as_loaded quantized already stay).
    Returns the number of expert stacks the model holds in 4 bits."""
    stacks, before, after = 0, 0, 0
    for module, pname in fused_expert_slots(model):
        param = getattr(module, pname)
        if not isinstance(param, Experts4bit):
            param = torch.nn.Parameter(quantize_experts(param.data, quant_type, block_size, block_scale),
                                       requires_grad=False)
            setattr(module, pname, param)
        before += param.numel() * param.element_size()
        after += param.storage_bytes()
        stacks += 1
    if stacks:
        logger.info(f"qlora: {stacks} fused expert stacks held in 4 bits ({quant_type}, blocks of {block_size}, "
                    f"{block_scale} scales): {after / 2**30:.2f} GiB instead of {before / 2**30:.2f}")
    return stacks


@contextlib.contextmanager
def experts_quantized_as_loaded(quant_type: str, block_size: int, block_scale: str):
    """Within: a model transformers loads has each fused expert stack quantized as soon as it is set into the model
    (transformers 5's core_model_loading.set_param_for_module, called once per tensor with the whole fused stack), so
    the load holds one 16-bit stack at a time instead of all of them (55.6 -> 16 GiB at Qwen3-30B-A3B's shape).
    The load runs synchronously (HF_DEACTIVATE_ASYNC_LOAD, as transformers 5.24 itself does for on-the-fly
    quantization): its worker threads would otherwise read every 16-bit tensor onto the device ahead of the
    quantization (transformers 5.17 with a bitsandbytes config; any version for a pre-quantized checkpoint).
    A transformers without that function loads as it is; quantize_fused_experts after the load catches any stack
    this missed."""
    try:
        from transformers import core_model_loading
    except ImportError:
        yield
        return
    original = getattr(core_model_loading, "set_param_for_module", None)
    if original is None:
        yield
        return

    def set_and_quantize(model, target_name, *args, **kwargs):
        original(model, target_name, *args, **kwargs)
        module_path, _, name = target_name.rpartition(".")
        try:
            module = model.get_submodule(module_path) if module_path else model
        except AttributeError:
            return
        param = module._parameters.get(name)
        if param is not None and param.dim() == 3 and not isinstance(param, Experts4bit) and \
                param.device.type != "meta" and not isinstance(module, torch.nn.modules.conv._ConvNd):
            quantized = torch.nn.Parameter(quantize_experts(param.data, quant_type, block_size, block_scale),
                                           requires_grad=False)
            quantized._is_hf_initialized = True  # (transformers would initialize it again otherwise)
            setattr(module, name, quantized)

    core_model_loading.set_param_for_module = set_and_quantize
    asynchronous = os.environ.get(SYNC_LOAD)
    os.environ[SYNC_LOAD] = "1"
    try:
        yield
    finally:
        core_model_loading.set_param_for_module = original
        if asynchronous is None:
            os.environ.pop(SYNC_LOAD, None)
        else:
            os.environ[SYNC_LOAD] = asynchronous


SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"


def parameter_bytes(param) -> int:
    """Bytes a parameter holds in memory: a 4-bit expert stack its codes and states, any other its elements."""
    if isinstance(param, Experts4bit):
        return param.storage_bytes()
    return param.numel() * param.element_size()
