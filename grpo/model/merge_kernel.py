"""One GPU pass per LoRA layer for a merged sync written in place (grpo.model.weight_sync._lora_merged_into):

    out = round( W + s * (B @ A) )        B [out, r] and A [r, in] rounded to out's dtype, the product and the sum in
                                          fp32, s = alpha / r; `out` is the engine's own tensor (bf16 or fp16)

where W is the frozen base weight: 16-bit (lora), or 4-bit nf4 as bitsandbytes stores it (qlora), dequantized as its
dequantize_4bit does and rounded to out's dtype first:

    W[i]      = round( NF4[q[i]] * absmax[i // blocksize] )                         (two 4-bit codes a byte, high first)
    absmax[b] = code2[q2[b]] * absmax2[b // blocksize2] + offset                    (double-quantized scales)

The unfused path (dequantize_4bit into out, then out.addmm_) writes out and reads it back, and dequantizes each
layer's scales into a temporary first; this kernel reads the codes and writes out once. It needs Triton (it comes
with CUDA builds of torch) and is imported only where a sync writes into a CUDA tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo.model.weight_sync import is_4bit

ROWS, COLUMNS = 64, 128  # the output tile of one program


@triton.jit
def _merge(out_ptr, w_ptr, code_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, b_ptr, a_ptr, scale, M, N, R,
           BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, FOUR_BIT: tl.constexpr, NESTED: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    idx = rows[:, None].to(tl.int64) * N + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    if FOUR_BIT:  # a row of N codes is N / 2 bytes and N / BLOCKSIZE whole blocks (`fits` checks)
        HALF: tl.constexpr = BN // 2
        PER_ROW: tl.constexpr = BN // BLOCKSIZE
        byte_cols = tl.program_id(1) * HALF + tl.arange(0, HALF)
        packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * (N // 2) + byte_cols[None, :],
                         mask=row_ok[:, None] & (byte_cols[None, :] < N // 2), other=0).to(tl.int32)
        codes = tl.join(tl.load(code_ptr + (packed >> 4)), tl.load(code_ptr + (packed & 15)))  # [BM, HALF, 2]
        block_cols = tl.program_id(1) * PER_ROW + tl.arange(0, PER_ROW)
        block_ok = row_ok[:, None] & (block_cols[None, :] < N // BLOCKSIZE)
        blocks = rows[:, None].to(tl.int64) * (N // BLOCKSIZE) + block_cols[None, :]       # [BM, PER_ROW]
        if NESTED:
            scale_codes = tl.load(absmax_ptr + blocks, mask=block_ok, other=0).to(tl.int32)
            absmax = tl.load(code2_ptr + scale_codes) * tl.load(absmax2_ptr + blocks // BLOCKSIZE2, mask=block_ok,
                                                                other=0.0)
            absmax = absmax + tl.load(offset_ptr)
        else:
            absmax = tl.load(absmax_ptr + blocks, mask=block_ok, other=0.0)
        weight = tl.reshape(tl.reshape(codes, [BM, PER_ROW, BLOCKSIZE]) * absmax[:, :, None], [BM, BN]).to(dtype)
    else:
        weight = tl.load(w_ptr + idx, mask=mask, other=0.0)
    ranks = tl.arange(0, BR)
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < R), other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * N + cols[None, :], mask=(ranks[:, None] < R) & col_ok[None, :], other=0.0)
    delta = tl.dot(b.to(dtype), a.to(dtype))  # fp32 accumulation
    tl.store(out_ptr + idx, (weight.to(tl.float32) + scale * delta).to(dtype), mask=mask)


MAX_RANK = 64  # B's and A's tiles in shared memory (24 KiB at 64 in 16 bits), within what any GPU since Ampere has


def fits(out: torch.Tensor, weight, lora_b: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether merge_into can write this layer: `out` a contiguous 16-bit CUDA tensor (bf16 from compute capability
    8.0), B and A contiguous floating-point tensors on its device with a rank of at most MAX_RANK, and the weight in
    out's dtype and shape, or 4-bit nf4 codes in bytes whose dequantized dtype is out's, in blocks of at most 128 that
    tile a row. Anything else takes the unfused path."""
    if not (out.is_cuda and out.is_contiguous() and out.dtype in (torch.bfloat16, torch.float16)):
        return False
    if out.dtype == torch.bfloat16 and torch.cuda.get_device_capability(out.device)[0] < 8:
        return False
    if not all(t.device == out.device and t.is_contiguous() and t.dtype.is_floating_point for t in (lora_b, lora_a)):
        return False
    if not (lora_b.shape[1] == lora_a.shape[0] <= MAX_RANK and lora_b.shape[0] == out.shape[0]
            and lora_a.shape[1] == out.shape[1]):
        return False
    if is_4bit(weight):
        state = weight.quant_state
        if state is None or weight.data.device != out.device or weight.data.dtype != torch.uint8:
            return False  # (codes stored in another dtype, e.g. bnb_4bit_quant_storage=bfloat16)
        return (state.quant_type == "nf4" and state.dtype == out.dtype and tuple(state.shape) == tuple(out.shape)
                and state.blocksize <= COLUMNS and out.shape[1] % state.blocksize == 0
                and state.code.device == out.device and weight.data.is_contiguous()
                and not getattr(state, "packing_format_for_cpu", False))
    return (weight.device == out.device and weight.dtype == out.dtype and weight.shape == out.shape
            and weight.is_contiguous())


def merge_into(out: torch.Tensor, weight, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float) -> torch.Tensor:
    """out <- W + scale * lora_b @ lora_a in one pass (the equation above); the caller checked `fits`."""
    rows, columns = out.shape
    rank = lora_a.shape[0]
    grid = (triton.cdiv(rows, ROWS), triton.cdiv(columns, COLUMNS))
    common = dict(BM=ROWS, BN=COLUMNS, BR=max(16, triton.next_power_of_2(rank)),
                  enable_fp_fusion=False)  # bitsandbytes rounds the scale's product before adding the offset
    if is_4bit(weight):
        state = weight.quant_state
        nested = bool(state.nested)
        scales = state.state2 if nested else state
        _merge[grid](out, weight.data, state.code, state.absmax, scales.code, scales.absmax,
                     state.offset if nested else state.absmax, lora_b, lora_a, float(scale), rows, columns, rank,
                     BLOCKSIZE=state.blocksize, BLOCKSIZE2=scales.blocksize if nested else 1, FOUR_BIT=True,
                     NESTED=nested, **common)
    else:
        _merge[grid](out, weight.data, out, out, out, out, out, lora_b, lora_a, float(scale), rows, columns, rank,
                     BLOCKSIZE=1, BLOCKSIZE2=1, FOUR_BIT=False, NESTED=False, **common)
    return out
