"""One GPU pass per LoRA layer for a merged sync written in place (grpo.sync.weight_sync._lora_merged_into):

    out = round( W + s * (B @ A) )        B [out, r] and A [r, in] rounded to out's dtype, the product and the sum in
                                          fp32, s = alpha / r; `out` is the engine's own tensor (bf16 or fp16)

where W is the frozen base weight: 16-bit (lora), or 4-bit nf4 as bitsandbytes stores it (qlora), dequantized as its
dequantize_4bit does and rounded to out's dtype first:

    W[i]      = round( NF4[q[i]] * absmax[i // blocksize] )                         (two 4-bit codes a byte, high first)
    absmax[b] = code2[q2[b]] * absmax2[b // blocksize2] + offset                    (double-quantized scales)

The unfused path (dequantize_4bit into out, then out.addmm_) writes out and reads it back, and dequantizes each
layer's scales into a temporary first; this kernel reads the codes and writes out once. It needs Triton (it comes
with CUDA builds of torch) and is imported only where a sync writes into a CUDA tensor.

The recorded merge of lora's in-place mode (grpo.sync.in_place_merge) has its own pair of kernels below: one writes
W' = round(W + s * B @ A) over a 16-bit W in place with a 2-bit code per element (and the elements it keeps beside),
one takes it out again. Their s * B @ A is one tl.dot per 32 x 64 block, the same in both, so the two agree.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo.model.layer_weights import is_4bit
from grpo.sync import merge_record
from grpo.sync.merge_record import KERNEL_MAX_RANK, LayerRecord, restore_escapes

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


# B's and A's tiles in shared memory (24 KiB at 64 in 16 bits), within what any GPU since Ampere has; the number lives
# where torch without Triton can read it (auto's rule asks it before this module can be imported)
MAX_RANK = KERNEL_MAX_RANK


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


# ------------------------------------------------------------------- the recorded merge (grpo.sync.in_place_merge)
# A program takes 32 rows x 256 columns as four column blocks of 64; byte j of its 64 bytes of codes per row holds
# the code of column j of block q in bits 2q..2q+1, so that no tile is reshaped. Codes: [rows, code_columns(N)].
# (On an H100 at Qwen2.5-7B's shape this tiling ran both passes 2-3x faster than 64 x 128 as four blocks of 32.)
RECORD_ROWS, BLOCK_COLUMNS = 32, 64


@triton.jit
def _rows_and_b(b_ptr, M, R, BM: tl.constexpr, BR: tl.constexpr):
    """The program's rows and B's rows for them [BM, BR] (zero past the rank and the last row)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    ranks = tl.arange(0, BR)
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & (ranks[None, :] < R), other=0.0)
    return rows, row_ok, b


@triton.jit
def _lora_delta(b, a_ptr, cols, col_ok, N, scale, R, BR: tl.constexpr):
    """D = s * (B @ A) for one block: B's rows [BM, BR] (loaded once per program) times A's columns, one tl.dot with
    fp32 accumulation, of the same shapes in the merge and the unmerge, so both get the same D."""
    ranks = tl.arange(0, BR)
    a = tl.load(a_ptr + ranks[:, None] * N + cols[None, :], mask=(ranks[:, None] < R) & col_ok[None, :], other=0.0)
    return tl.dot(b, a) * scale


@triton.jit
def _merge_recording(w_ptr, b_ptr, a_ptr, codes_ptr, escape_index_ptr, escape_bits_ptr, counter_ptr, capacity, scale,
                     M, N, CODE_COLUMNS, R, BM: tl.constexpr, BR: tl.constexpr, BQ: tl.constexpr):
    rows, row_ok, b = _rows_and_b(b_ptr, M, R, BM, BR)
    dtype = w_ptr.dtype.element_ty
    packed = tl.zeros([BM, BQ], dtype=tl.int32)
    for q in tl.static_range(4):
        cols = tl.program_id(1) * 4 * BQ + q * BQ + tl.arange(0, BQ)
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        idx = rows[:, None].to(tl.int64) * N + cols[None, :]
        weight = tl.load(w_ptr + idx, mask=mask, other=0.0)
        delta = _lora_delta(b, a_ptr, cols, col_ok, N, scale, R, BR)
        merged = (weight.to(tl.float32) + delta).to(dtype)                               # W' = round(W + D)
        guess = (merged.to(tl.float32) - delta).to(dtype)                                # g  = round(W' - D)
        weight_bits = weight.to(tl.int16, bitcast=True)
        miss = weight_bits.to(tl.int32) - guess.to(tl.int16, bitcast=True).to(tl.int32)  # c  = bits(W) - bits(g)
        escaped = ((miss > 1) | (miss < -1)) & mask
        packed = packed | (tl.where(escaped, 3, miss + 1) << (2 * q))
        out = merged
        flags = escaped.to(tl.int32)
        total = tl.sum(tl.sum(flags, axis=1), axis=0)
        if total > 0:  # each escape takes the next free slot; one that finds none leaves its element unmerged
            per_row = tl.sum(flags, axis=1)
            first = tl.atomic_add(counter_ptr, total)
            slot = first + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(flags, axis=1) - 1
            kept = escaped & (slot < capacity)
            tl.store(escape_index_ptr + slot, idx.to(tl.int32), mask=kept)
            tl.store(escape_bits_ptr + slot, weight_bits, mask=kept)
            out = tl.where(escaped & (slot >= capacity), weight, merged)
        tl.store(w_ptr + idx, out, mask=mask)
    byte_cols = tl.program_id(1) * BQ + tl.arange(0, BQ)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * CODE_COLUMNS + byte_cols[None, :], packed.to(tl.uint8),
             mask=row_ok[:, None] & (byte_cols[None, :] < CODE_COLUMNS))


@triton.jit
def _unmerge_recorded(w_ptr, b_ptr, a_ptr, codes_ptr, scale, M, N, CODE_COLUMNS, R, BM: tl.constexpr,
                      BR: tl.constexpr, BQ: tl.constexpr):
    rows, row_ok, b = _rows_and_b(b_ptr, M, R, BM, BR)
    dtype = w_ptr.dtype.element_ty
    byte_cols = tl.program_id(1) * BQ + tl.arange(0, BQ)
    packed = tl.load(codes_ptr + rows[:, None].to(tl.int64) * CODE_COLUMNS + byte_cols[None, :],
                     mask=row_ok[:, None] & (byte_cols[None, :] < CODE_COLUMNS), other=0).to(tl.int32)
    for q in tl.static_range(4):
        cols = tl.program_id(1) * 4 * BQ + q * BQ + tl.arange(0, BQ)
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        idx = rows[:, None].to(tl.int64) * N + cols[None, :]
        merged = tl.load(w_ptr + idx, mask=mask, other=0.0)
        delta = _lora_delta(b, a_ptr, cols, col_ok, N, scale, R, BR)
        guess = (merged.to(tl.float32) - delta).to(dtype)                                # g = round(W' - D)
        code = (packed >> (2 * q)) & 3
        restored = (guess.to(tl.int16, bitcast=True).to(tl.int32) + code - 1).to(tl.int16).to(dtype, bitcast=True)
        tl.store(w_ptr + idx, tl.where(code == 3, merged, restored), mask=mask)


def code_columns(columns: int) -> int:
    """Bytes of codes per row: one per column of a program's first block (the last program whole)."""
    return triton.cdiv(columns, 4 * BLOCK_COLUMNS) * BLOCK_COLUMNS


def _recorded_launch(weight: torch.Tensor, lora_a: torch.Tensor) -> tuple:
    rows, columns = weight.shape
    grid = (triton.cdiv(rows, RECORD_ROWS), triton.cdiv(columns, 4 * BLOCK_COLUMNS))
    # one launch setting for both kernels (Triton's defaults on CUDA), so that their tl.dot compiles alike
    return grid, dict(BM=RECORD_ROWS, BR=max(16, triton.next_power_of_2(lora_a.shape[0])), BQ=BLOCK_COLUMNS,
                      num_warps=4, num_stages=3, enable_fp_fusion=False)


def fits_recorded(weight: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether the recorded kernels take this layer: a contiguous 16-bit CUDA weight (bf16 from compute capability
    8.0) of fewer than 2^31 elements, with B on its device, contiguous, in its dtype, of a rank of at most MAX_RANK."""
    if not (weight.is_cuda and weight.is_contiguous() and weight.dtype in (torch.bfloat16, torch.float16)):
        return False
    if weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device)[0] < 8:
        return False
    return (weight.dim() == 2 and weight.numel() < 2**31 and lora_b.shape[1] <= MAX_RANK
            and lora_b.device == weight.device and lora_b.dtype == weight.dtype and lora_b.is_contiguous())


def merge_recording(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float, record=None):
    """weight <- round(W + s * B @ A) in place, as grpo.sync.in_place_merge.merge_recording, in one pass (codes in
    this kernel's layout); `record`: the layer's buffers from an earlier merge, reused. The escapes are counted on
    the GPU: read_escape_counts."""
    rows, columns = weight.shape
    record = record if record is not None else new_record(weight)
    record.counter.zero_()
    grid, constants = _recorded_launch(weight, lora_a)
    _merge_recording[grid](weight, lora_b, lora_a, record.codes, record.escape_index, record.escape_bits,
                           record.counter, record.escape_index.numel(), float(scale), rows, columns,
                           code_columns(columns), lora_a.shape[0], **constants)
    return record


def new_record(weight: torch.Tensor):
    """A layer's buffers for the recorded merge: its codes in this kernel's layout, a first escape buffer
    (FIRST_ESCAPE_SHARE of its elements, at least 1024) and the kernel's escape counter."""
    rows, columns = weight.shape
    capacity = max(1024, int(weight.numel() * merge_record.FIRST_ESCAPE_SHARE))  # (read at each call: a test lowers it)
    return LayerRecord(torch.empty(rows, code_columns(columns), dtype=torch.uint8, device=weight.device),
                       torch.empty(capacity, dtype=torch.int32, device=weight.device),
                       torch.empty(capacity, dtype=torch.int16, device=weight.device),
                       counter=torch.zeros(1, dtype=torch.int32, device=weight.device))


def read_escape_counts(layers: list, must_fit: bool = False) -> list:
    """Set each layer's record.escapes from the kernel's counts (one read for all); returns the layers whose escapes
    outgrew their buffer (their extra elements were left unmerged)."""
    counts = torch.cat([layer.record.counter for layer in layers]).tolist()
    overflowed = []
    for layer, count in zip(layers, counts):
        capacity = layer.record.escape_index.numel()
        layer.record.escapes, layer.record.needed = min(count, capacity), count
        if count > capacity:
            overflowed.append(layer)
    if overflowed and must_fit:
        raise RuntimeError(f"the in-place merge's escapes outgrew a buffer sized for them ({counts})")
    return overflowed


def grown(record):
    """The record with an escape buffer for every escape its last merge had, and a quarter more."""
    capacity = record.needed + record.needed // 4 + 1024
    device = record.codes.device
    record.escape_index = torch.empty(capacity, dtype=torch.int32, device=device)
    record.escape_bits = torch.empty(capacity, dtype=torch.int16, device=device)
    record.escapes = 0
    return record


def unmerge_recorded(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, scale: float, record) -> None:
    """weight <- W from W' and its record in one pass, then the kept elements written back."""
    rows, columns = weight.shape
    grid, constants = _recorded_launch(weight, lora_a)
    _unmerge_recorded[grid](weight, lora_b, lora_a, record.codes, float(scale), rows, columns, code_columns(columns),
                            lora_a.shape[0], **constants)
    restore_escapes(weight, record)
