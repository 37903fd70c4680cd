"""lora with one 16-bit base: the adapter merged into the base the trainer and vLLM share, for a rollout, and taken
out again, bit for bit, before the trainer reads it.

The trainer's frozen base tensors are views of the engine's (grpo.sync.shared_base), so the engine samples the
merged policy at merged speed, and the GPU holds the base once. Per element of a LoRA layer's weight W (16 bits):

    D  = s * (B @ A)                 B [out, r], A [r, in] rounded to W's dtype, the product in fp32, s = alpha / r
    W' = round(W + D)                what the engine samples with (the merged sync's weight)
    g  = round(W' - D)               the unmerge's guess: W itself in all but about 0.1-4% of the elements
    c  = bits(W) - bits(g)           (the weights' bit patterns as integers: c = +-1 is one step of the format)

Rounding makes g miss W where W + D rounds across more than one of W's steps (|W| small next to |D|, or a power of 2
crossed), so the merge also records, per element, code = c + 1 for c in {-1, 0, 1}, else ESCAPE, with W itself
kept beside it (its index and bits); the unmerge then writes bits(g) + code - 1, or W. A 2-bit code per element (a
byte holds four) costs an eighth of the 16-bit base: 1.6 GiB for Qwen2.5-7B's linear layers, where a second copy
of the base is 14.2 GiB. D must be the same number in the merge and the unmerge: both take it from one function
(in torch a loop of fp32 multiply-adds; in the Triton kernels one tl.dot per tile of the same shapes in both),
so the round trip is exact.

On the GPU one Triton pass per layer merges (reads W, writes W' and the codes) and one unmerges
(grpo.sync.merge_kernel); elsewhere the same equations run in torch. The escapes of a kernel pass go to a buffer of
a fixed size per layer; an element whose escape finds no room is left unmerged (code ESCAPE, W unchanged), the layer
is counted as overflowed, and merge() takes it out again and merges it once more with a buffer that holds them all.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo.errors import ConfigError
from grpo.model.layer_weights import lora_adapters, plain_lora
from grpo.runtime.signals import signals_held
from grpo.sync.merge_record import BITS_OF, CODES_PER_BYTE, ESCAPE, LayerRecord, restore_escapes

logger = logging.getLogger("grpo")
_SAID_NO_KERNEL: list[Exception] = []  # the kernels' import failure, said once


@dataclass
class MergedLayer:
    """One LoRA layer merged in place: its weight (the tensor the engine reads) and the adapter merged into it."""
    weight: torch.Tensor                  # [out, in], 16-bit, contiguous
    lora_b: torch.Tensor                  # [out, r] in weight's dtype
    lora_a: torch.Tensor                  # [r, in] in weight's dtype
    scale: float
    record: Optional[LayerRecord] = None
    use_kernel: bool = field(default=False)
    merged: bool = False                  # W' in place (its record then says how to take it out)


def can_merge_in_place(weight: torch.Tensor) -> bool:
    """A weight the recorded merge can take: 16 or 32 bits, contiguous, a whole number of code bytes per row, and
    small enough for int32 positions."""
    return (weight.dtype.is_floating_point and weight.element_size() in BITS_OF and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] % CODES_PER_BYTE == 0 and 0 < weight.numel() < 2**31)


# ------------------------------------------------------------------------------------------- the equations in torch
def lora_delta(lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float) -> torch.Tensor:
    """D = s * (B @ A) in fp32 [out, in]: the rank's products added in order, one multiply-add at a time (as the
    kernel does), so that the merge and the unmerge compute the same D."""
    delta = torch.zeros(lora_b.shape[0], lora_a.shape[1], dtype=torch.float32, device=lora_b.device)
    for k in range(lora_a.shape[0]):
        delta += lora_b[:, k, None].float() * lora_a[None, k, :].float()
    return delta * scale


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3 [n], n a multiple of 4 -> [n / 4] bytes, element 4j + i in bits 2i..2i+1 of byte j."""
    quads = codes.reshape(-1, CODES_PER_BYTE).to(torch.uint8)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """pack_codes' inverse: [n / 4] bytes -> [n] codes."""
    shifts = torch.arange(0, 8, 2, device=packed.device, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)


def merge_recording(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float) -> LayerRecord:
    """weight <- round(W + D) in place; returns what unmerge_recorded needs to give W back exactly."""
    bits = BITS_OF[weight.element_size()]
    delta = lora_delta(lora_b, lora_a, scale)
    merged = (weight.float() + delta).to(weight.dtype)                        # W' = round(W + D)
    guess = (merged.float() - delta).to(weight.dtype)                        # g  = round(W' - D)
    miss = weight.view(bits).long() - guess.view(bits).long()                # c  = bits(W) - bits(g)
    escaped = miss.abs() > 1
    codes = torch.where(escaped, torch.full_like(miss, ESCAPE), miss + 1).reshape(-1)
    index = escaped.reshape(-1).nonzero().squeeze(1)
    record = LayerRecord(pack_codes(codes), index.to(torch.int32), weight.view(bits).reshape(-1)[index].clone(),
                         escapes=index.numel())
    weight.copy_(merged)
    return record


def unmerge_recorded(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float,
                     record: LayerRecord) -> None:
    """weight <- W, from W' (what merge_recording left) and its record."""
    bits = BITS_OF[weight.element_size()]
    guess = (weight.float() - lora_delta(lora_b, lora_a, scale)).to(weight.dtype)     # g = round(W' - D)
    codes = unpack_codes(record.codes).reshape(weight.shape).long()
    restored = (guess.view(bits).long() + codes - 1).to(bits)                        # bits(g) + c
    weight.view(bits).copy_(torch.where(codes == ESCAPE, weight.view(bits), restored))
    restore_escapes(weight, record)


# ---------------------------------------------------------------------------------------------------- the state
class InPlaceMerge:
    """The adapter of every LoRA layer, merged into the shared base on merge() and taken out on unmerge()."""

    def __init__(self):
        self.layers: list[MergedLayer] = []

    @property
    def merged(self) -> bool:
        """Whether any layer holds W' (a merge or unmerge cut off halfway leaves some: the next call finishes it)."""
        return any(layer.merged for layer in self.layers)

    @property
    def whole(self) -> bool:
        """Whether every layer holds W' (what the engine must sample with)."""
        return all(layer.merged for layer in self.layers)

    def set_adapter(self, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]) -> None:
        """The adapter to merge from now on: (weight, B, A, scale) per layer, B and A copied (in weight's dtype, as
        the merge rounds them) so that later updates of the trainer's own leave the unmerge exact. Taken while
        unmerged only; the records of a previous adapter are reused, and a kernel layer's are made here (the first
        sync), so that the memory they take is in use before the trainer sizes its micro-batches."""
        if self.merged:
            raise RuntimeError("the adapter of a merged base cannot change: unmerge() first")
        previous = {layer.weight.data_ptr(): layer for layer in self.layers}
        new_layers, targets, sources = [], [], []
        for weight, lora_b, lora_a, scale in layers:
            if not can_merge_in_place(weight):
                raise ValueError(f"a {tuple(weight.shape)} {weight.dtype} weight cannot be merged in place")
            old = previous.get(weight.data_ptr())
            if old is not None and old.weight.shape != weight.shape:
                old = None
            if old is not None and old.lora_b.shape == lora_b.shape and old.lora_a.shape == lora_a.shape:
                # the last sync's copies, overwritten below in one batched copy (a sync is then a few launches)
                layer = MergedLayer(weight, old.lora_b, old.lora_a, float(scale))
                targets += [old.lora_b, old.lora_a]
                sources += [lora_b.detach(), lora_a.detach()]
            else:
                layer = MergedLayer(weight, lora_b.detach().to(weight.dtype, copy=True).contiguous(),
                                    lora_a.detach().to(weight.dtype, copy=True).contiguous(), float(scale))
            layer.use_kernel = _kernel_fits(weight, layer.lora_b)
            if layer.use_kernel:  # the layer's last buffers where the kernel made them (torch's have another layout)
                from grpo.sync import merge_kernel

                layer.record = old.record if old is not None and old.use_kernel else merge_kernel.new_record(weight)
            new_layers.append(layer)
        if targets:
            torch._foreach_copy_(targets, sources)  # rounded to the weight's dtype, as .to() does
        self.layers = new_layers  # (an error above leaves the last adapter whole)

    @property
    def adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.lora_b, layer.lora_a))

    @property
    def record_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.record is not None
                   for t in (layer.record.codes, layer.record.escape_index, layer.record.escape_bits))

    def merge(self) -> None:
        """Every layer merged, or (on an error) none: the layers done are taken out again before it propagates. A
        signal is handled after the loop, so that no layer's launch is parted from the flag that records it."""
        by_kernel = []
        try:
            with signals_held():
                for layer in self.layers:
                    if layer.merged:
                        continue
                    if layer.use_kernel:
                        from grpo.sync import merge_kernel

                        layer.record = merge_kernel.merge_recording(layer.weight, layer.lora_b, layer.lora_a,
                                                                    layer.scale, layer.record)
                        by_kernel.append(layer)
                    else:
                        layer.record = merge_recording(layer.weight, layer.lora_b, layer.lora_a, layer.scale)
                    layer.merged = True
                if by_kernel:  # one read of the kernel's escape counts for all its layers
                    from grpo.sync import merge_kernel

                    overflowed, by_kernel = merge_kernel.read_escape_counts(by_kernel), []
                    for layer in overflowed:
                        # its elements left unmerged are still W: take the layer out, merge it with room for every
                        # escape
                        self._unmerge_layer(layer)
                        layer.record = merge_kernel.merge_recording(layer.weight, layer.lora_b, layer.lora_a,
                                                                    layer.scale, merge_kernel.grown(layer.record))
                        layer.merged = True
                        merge_kernel.read_escape_counts([layer], must_fit=True)
        except BaseException:
            if by_kernel:  # merged by the kernel, their escapes not yet counted
                from grpo.sync import merge_kernel

                merge_kernel.read_escape_counts(by_kernel)
            self.unmerge()
            raise

    def unmerge(self) -> None:
        """Every merged layer back to W (one cut off halfway by an error is finished by the next call; a signal is
        handled after the loop)."""
        with signals_held():
            for layer in self.layers:
                if layer.merged:
                    self._unmerge_layer(layer)

    @staticmethod
    def _unmerge_layer(layer: MergedLayer) -> None:
        if layer.use_kernel:
            from grpo.sync import merge_kernel

            merge_kernel.unmerge_recorded(layer.weight, layer.lora_b, layer.lora_a, layer.scale, layer.record)
        else:
            unmerge_recorded(layer.weight, layer.lora_b, layer.lora_a, layer.scale, layer.record)
        layer.merged = False


def _kernel_fits(weight: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the Triton kernels take this layer (a 16-bit CUDA weight, Triton installed); else torch does."""
    if not weight.is_cuda or weight.element_size() != 2:
        return False
    try:
        from grpo.sync import merge_kernel
    except ImportError as exc:
        if not _SAID_NO_KERNEL:
            _SAID_NO_KERNEL.append(exc)
            logger.warning(f"the in-place merge runs in torch, far slower than its Triton kernels, which could not "
                           f"be imported ({exc})")
        return False
    return merge_kernel.fits_recorded(weight, lora_b)


def in_place_layers(model) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """(base weight, B, A, scale) of every LoRA layer of a peft model with one plain adapter active per layer (what
    --rollout_weights in_place takes); a clear error for anything else."""
    layers = []
    for name, module in model.named_modules():
        if not (hasattr(module, "lora_A") and hasattr(module, "get_base_layer")):
            continue
        adapters = lora_adapters(module)
        if len(adapters) > 1 or not plain_lora(module, adapters):
            raise ConfigError(f"--rollout_weights in_place merges one plain LoRA adapter per layer ({name} has "
                              f"{len(adapters)}, fan_in_fan_out or lora_bias): use --rollout_weights merged")
        if adapters:
            adapter = adapters[0]
            layers.append((module.get_base_layer().weight.data, module.lora_B[adapter].weight.data,
                           module.lora_A[adapter].weight.data, module.scaling[adapter]))
    return layers
